"""Config loading: every shipped config parses and dry-runs; bad keys and values are named."""

from pathlib import Path

import pytest

from opsd.config import ConfigError, config_from_dict, load_config
from opsd.train import main

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


def test_reference_recipe_has_reference_hyperparameters():
    cfg = load_config("configs/visual_opsd_qwen25vl_7b.yaml")
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.max_steps) == (1e-5, 1e-7, 200, 1000)
    assert tuple(cfg.optim.betas) == (0.9, 0.95) and cfg.optim.eps == 1e-15 and cfg.optim.max_grad_norm == 1.0
    assert (cfg.loss.beta, cfg.loss.top_k, cfg.loss.token_clip, cfg.loss.ce_weight, cfg.loss.jsd_weight) == (0.5, 256, 0.05, 0, 1)
    assert cfg.teacher.mode == "ema" and cfg.teacher.ema_decay == 0.995
    assert cfg.train.grad_accum_steps == 2 and cfg.train.max_forward_tokens == 10240
    assert cfg.rollout.max_new_tokens == 1024 and cfg.model.dtype == "bfloat16"


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
        ("teacher", {"mode": "twin"}, "teacher.mode"),
        ("optim", {"lr": "fast"}, "optim.lr"),
        ("train", {"max_steps": 0}, "train.max_steps"),
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


def test_overrides_index_lists():
    cfg = load_config("configs/text_opsd_smollm2.yaml", ["data.datasets.0.path=/data/x", "data.datasets.0.weight=2"])
    assert cfg.data.datasets[0].path == "/data/x" and cfg.data.datasets[0].weight == 2.0
    with pytest.raises(ConfigError, match="not an index of a list of 1"):
        load_config("configs/text_opsd_smollm2.yaml", ["data.datasets.1.path=/data/y"])


def test_recipes_use_their_schemas():
    thinkmorph = load_config("configs/visual_opsd_thinkmorph.yaml")
    assert {d.schema for d in thinkmorph.data.datasets} == {"thinkmorph"} and thinkmorph.prompts.privileged == ["images"]
    for name in ("text_opsd_qwen3_1p7b.yaml", "text_opsd_smollm2.yaml"):
        cfg = load_config(f"configs/{name}")
        assert {d.schema for d in cfg.data.datasets} == {"text"} and cfg.prompts.privileged == ["text"]
        assert cfg.eval.every > 0 and cfg.eval.with_teacher_prompt
