"""Config loading: every shipped config parses and dry-runs; bad keys and values are named."""

import ast
from pathlib import Path

import pytest
import torch

from opsd import config as config_module
from opsd.config import ConfigError, ModelConfig, OptimConfig, config_from_dict, load_config
from opsd.data.sample import Sample
from opsd.data.synthetic import generate_samples
from opsd.modeling import load_processor
from opsd.prompts import student_prompt, teacher_prompt
from opsd.train import main
from opsd.trainer.optim import build_optimizer, build_scheduler, warmup_warning

CONFIGS = sorted(Path(__file__).parents[2].glob("configs/*.yaml"))
MINIMAL = {"model": {"path": "m"}, "data": {"path": "d"}}


def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "visual_opsd_qwen25vl_7b.yaml", "visual_opsd_smolvlm.yaml"} <= names
    assert {"visual_opsd_thinkmorph.yaml", "text_opsd_qwen3_1p7b.yaml", "text_opsd_smollm2.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_dry_runs(path, capsys):
    assert main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "optimizer steps" in out


def test_reference_recipe_schedule_warms_up_then_decays_to_its_floor():
    """The paper's schedule as the recipe runs it: linear warm-up over 200 steps to 1e-5 (step 1 at
    1/200 of it, not 0), cosine to 1e-7."""
    cfg = load_config("configs/visual_opsd_qwen25vl_7b.yaml")
    optimizer = build_optimizer(cfg.optim, torch.nn.Linear(2, 2))
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps)
    rates = []
    for _ in range(cfg.train.max_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(1e-5 / 200) and rates[99] == pytest.approx(5e-6) and max(rates) == pytest.approx(1e-5)
    assert rates.index(max(rates)) == 199  # step 200
    assert rates[-1] == pytest.approx(1e-7) and all(a >= b for a, b in zip(rates[199:], rates[200:]))
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95) and optimizer.param_groups[0]["eps"] == 1e-15


@pytest.mark.parametrize("warmup, expected", [(0, [1.0, 0.5, 0.0]), (1, [1.0, 0.5, 0.0]), (2, [0.5, 1.0, 0.0]),
                                              (3, [1 / 3, 2 / 3, 1.0]), (4, [0.25, 0.5, 0.75])])
def test_no_step_trains_at_lr_0_and_short_runs_are_warned(warmup, expected):
    """Step s of a W-step warm-up trains at s/W; cosine decays from the peak to min_lr at the last step.
    A run that ends inside (or with) its warm-up gets a plan warning."""
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=warmup)
    optimizer = build_optimizer(cfg, torch.nn.Linear(2, 2))
    scheduler = build_scheduler(cfg, optimizer, 3)
    rates = []
    for _ in range(3):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx(expected, abs=1e-12)
    warning = warmup_warning(cfg, 3)
    assert (warning is None) == (warmup < 3)
    if warmup == 4:
        assert "never (the last step trains at lr 0.75)" in warning


def test_every_config_field_has_a_docstring():
    """Each field of opsd/config.py's dataclasses is followed by its docstring (the docs link there)."""
    tree = ast.parse(Path(config_module.__file__).read_text())
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            body = node.body
            for field, following in zip(body, body[1:] + [None]):
                if isinstance(field, ast.AnnAssign):
                    documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    if not documented:
                        missing.append(f"{node.name}.{field.target.id}")
    assert missing == []


def test_overrides_apply_and_parse_yaml_scalars():
    cfg = load_config("configs/demo.yaml", ["train.max_steps=3", "rollout.engine=hf", "loss.beta=0", "prompts.privileged=[images,text]"])
    assert cfg.train.max_steps == 3 and cfg.rollout.engine == "hf" and cfg.loss.beta == 0.0
    assert cfg.prompts.privileged == ["images", "text"]


@pytest.mark.parametrize(
    "section, values, named",
    [
        ("rollout", {"temprature": 1.0}, "rollout.temprature"),
        ("rollout", {"temperature": -1}, "rollout.temperature"),
        ("rollout", {"engine": "sglang"}, "rollout.engine"),
        ("loss", {"beta": 1.5}, "loss.beta"),
        ("loss", {"clip_mode": "row"}, "loss.clip_mode"),
        ("loss", {"kind": "ppo"}, "loss.kind: must be one of jsd, tinker, sft"),
        ("loss", {"kind": "tinker", "top_k": 8}, "loss.top_k: a setting of loss.kind=jsd, not of tinker"),
        ("loss", {"kind": "tinker", "jsd_weight": 1}, "loss.jsd_weight: loss.kind=tinker calls it loss.tinker_weight"),
        ("loss", {"kind": "sft", "ce_weight": 0}, "loss.ce_weight"),
        ("loss", {"temperature": 1e30}, "loss.temperature: Value error, cannot give a finite loss"),
        ("train", {"max_bad_steps": 0}, "train.max_bad_steps"),
        ("teacher", {"mode": "twin"}, "teacher.mode"),
        ("optim", {"lr": "fast"}, "optim.lr"),
        ("train", {"max_steps": 0}, "train.max_steps: Input should be greater than 0; to evaluate a model or checkpoint "
                                    "without training: python -m opsd.evaluate"),
        ("bogus_section", {"x": 1}, "bogus_section"),
    ],
)
def test_bad_keys_and_values_are_named(section, values, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config_from_dict({**MINIMAL, section: values})


def test_missing_required_section_is_named():
    with pytest.raises(ConfigError, match="model"):
        config_from_dict({"data": {"path": "d"}})


def test_cross_field_check():
    with pytest.raises(ConfigError, match="min_lr"):
        config_from_dict({**MINIMAL, "optim": {"lr": 1e-5, "min_lr": 1e-3}})


def test_cli_reports_bad_override_without_traceback(capsys):
    assert main(["--config", "configs/demo.yaml", "--dry-run", "loss.top_k=-3"]) == 2
    assert "loss.top_k" in capsys.readouterr().err
    assert main(["--config", "configs/demo.yaml", "--dry-run", "no_equals_sign"]) == 2
    assert main(["--config", "configs/missing.yaml", "--dry-run"]) == 2


def test_a_text_that_yaml_reads_as_a_mapping_stays_text():
    """`Fact:` is a one-key mapping to YAML; as an override value it is the text, and a flow mapping is a mapping."""
    cfg = load_config("configs/demo.yaml", ["prompts.privileged_text_intro=Fact:", "prompts.system=Note: a: b"])
    assert cfg.prompts.privileged_text_intro == "Fact:" and cfg.prompts.system == "Note: a: b"
    assert load_config("configs/demo.yaml", ["loss={kind: tinker}"]).loss.kind == "tinker"
    with pytest.raises(ConfigError, match=r"prompts\.system: Input should be a valid string \(got \{'a': 1\}\)"):
        load_config("configs/demo.yaml", ["prompts.system={a: 1}"])


def test_an_override_of_data_datasets_replaces_data_path(tmp_path):
    """The demo names its data by data.path and data.synthetic; data.datasets=[...] alone replaces both (and back)."""
    cfg = load_config("configs/demo.yaml", [f"data.datasets=[{{path: {tmp_path}, schema: text}}]"])
    assert cfg.data.path is None and cfg.data.synthetic is None and cfg.data.datasets[0].path == str(tmp_path)
    cfg = load_config("configs/text_opsd_smollm2.yaml", [f"data.path={tmp_path}"])
    assert cfg.data.path == str(tmp_path) and cfg.data.datasets == []
    with pytest.raises(ConfigError, match="also set data.path=null data.synthetic=null"):
        config_from_dict({**MINIMAL, "data": {"path": "d", "datasets": [{"path": "e"}]}})


def test_overrides_index_lists():
    cfg = load_config("configs/text_opsd_smollm2.yaml", ["data.datasets.0.path=/data/x", "data.datasets.0.weight=2"])
    assert cfg.data.datasets[0].path == "/data/x" and cfg.data.datasets[0].weight == 2.0
    with pytest.raises(ConfigError, match="not an index of a list of 1"):
        load_config("configs/text_opsd_smollm2.yaml", ["data.datasets.1.path=/data/y"])


@pytest.mark.parametrize("name", ["text_opsd_qwen3_1p7b.yaml", "text_opsd_smollm2.yaml"])
def test_text_recipes_give_the_worked_solution_to_the_teacher_only(name, tiny_text_dir):
    cfg = load_config(f"configs/{name}")
    processor = load_processor(ModelConfig(path=str(tiny_text_dir)))
    sample = Sample(id="s", question="What is 2 + 3?", images=[], privileged_images=[],
                    privileged_text="2 + 3 = 5, so the answer is 5.", answer="5")
    assert "2 + 3 = 5" in teacher_prompt(sample, processor, cfg.prompts).text
    assert "2 + 3 = 5" not in student_prompt(sample, processor, cfg.prompts).text


def test_thinkmorph_recipe_shows_the_visual_thoughts_to_the_teacher_only(tiny_vlm_dir):
    cfg = load_config("configs/visual_opsd_thinkmorph.yaml")
    processor = load_processor(ModelConfig(path=str(tiny_vlm_dir)))
    sample = generate_samples(1, seed=0)[0]
    student, teacher = student_prompt(sample, processor, cfg.prompts), teacher_prompt(sample, processor, cfg.prompts)
    assert len(student.images) == len(sample.images)
    assert len(teacher.images) == len(sample.images) + len(sample.privileged_images) > len(student.images)
