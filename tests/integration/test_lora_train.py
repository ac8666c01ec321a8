"""LoRA training runs with the vLLM engine (float32, CPU), on the tiny VLM and the tiny text model:
the engine keeps up (adapter or merged sync), only the adapter changes, the base teacher stays the
initial model, resume is exact, `opsd.export --merge` gives a model transformers and vLLM load."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers.logprobs import TOLERANCE, engine_logprobs, sample_grid_eval_prompts, trainer_logprobs
from tests.helpers.runs import assert_same_steps, read_metrics, train_until_crash
from tests.helpers.samples import text_samples
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import opsd.train
from opsd import lora
from opsd.config import TeacherConfig, load_config
from opsd.export import main as export_main
from opsd.prompts import student_prompt
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt
from opsd.teacher import make_teacher
from opsd.trainer.checkpoint import list_checkpoints

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = "model.lora={rank: 8, alpha: 16}"


def vlm_config(output_dir, tiny_vlm_dir, grid_data_dir, *extra):
    return load_config("configs/smoke.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={output_dir}",
        "logging.progress_bar=false", "rollout.max_new_tokens=16", "train.max_steps=6", "checkpoint.save_every=3",
        "checkpoint.resume_from=null", "checkpoint.save_total_limit=null", "eval.every=0", LORA, *extra,
    ])


def text_config(output_dir, tiny_text_dir, data_dir, *extra):
    data = f"[{{path: {data_dir}, schema: text, synthetic: {{kind: arithmetic, n_train: 16, n_eval: 4}}}}]"
    return load_config("configs/smoke.yaml", [
        f"model.path={tiny_text_dir}", "data.path=null", "data.synthetic=null", f"data.datasets={data}",
        "prompts.privileged=[text]", f"logging.output_dir={output_dir}", "logging.progress_bar=false",
        "rollout.max_new_tokens=16", "train.max_steps=3", "train.max_forward_tokens=512", "eval.every=0",
        "checkpoint.resume_from=null", "checkpoint.save_total_limit=null", LORA, *extra,
    ])


def train_capturing_student(cfg):
    """Run `opsd.train.train`; returns the trained student module."""
    captured = {}

    def capture(teacher_cfg, student, *copy_student):
        captured["student"] = student
        return make_teacher(teacher_cfg, student, *copy_student)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opsd.train, "make_teacher", capture)
        opsd.train.train(cfg)
    return captured["student"]


def assert_base_weights_unchanged(student, initial):
    """Every weight outside the adapters is bit-identical to the model the run started from."""
    merged_names = dict(initial.named_parameters())
    base = {n.replace(".base_layer.", "."): p for n, p in student.named_parameters() if ".lora_" not in n}
    assert base.keys() == merged_names.keys()
    assert all(torch.equal(p.detach(), merged_names[n]) for n, p in base.items())


def adapter_weights(checkpoint):
    return {role: load_file(checkpoint / role / lora.ADAPTER_WEIGHTS) for role in ("model", "teacher")}


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory, tiny_vlm_dir, grid_data_dir):
    """6 steps of LoRA (adapter sync, EMA adapter teacher) on the tiny VLM, checkpoints at 3 and 6."""
    output_dir = tmp_path_factory.mktemp("lora-vlm") / "run"
    student = train_capturing_student(vlm_config(output_dir, tiny_vlm_dir, grid_data_dir))
    return output_dir, student


def test_vlm_adapter_sync_keeps_the_engine_on_policy(vlm_run, tiny_vlm_dir):
    output_dir, student = vlm_run
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["logprob_mismatch_max"] < 1e-3 for r in records)
    adapter_bytes = sum(p.numel() * p.element_size() for p in lora.adapter_parameters(student).values())
    model_bytes = sum(p.numel() * p.element_size() for n, p in student.named_parameters() if ".lora_" not in n)
    assert all(r["weight_sync_bytes"] == adapter_bytes for r in records)
    assert adapter_bytes < 0.2 * model_bytes  # tiny model: the adapter is large beside it, still a fraction

    initial = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    assert_base_weights_unchanged(student, initial)
    saved = adapter_weights(output_dir / "checkpoint-6")
    live = lora.adapter_tensors(student)
    assert saved["model"].keys() == live.keys() and all(torch.equal(saved["model"][k], live[k]) for k in live)
    assert any(not torch.equal(saved["model"][k], saved["teacher"][k]) for k in live)  # EMA lags the student
    assert any(k.endswith("lora_B.weight") and saved["model"][k].abs().max() > 0 for k in live)  # it trained
    config = json.loads((output_dir / "checkpoint-6" / "model" / lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(tiny_vlm_dir.resolve())


def test_vlm_resume_is_exact(vlm_run, tmp_path, tiny_vlm_dir, grid_data_dir, monkeypatch):
    """6 steps straight == 3 steps, a crash one step after checkpoint-3, a resume, 3 more steps."""
    reference_dir, _ = vlm_run
    output_dir = tmp_path / "run"
    train_until_crash(vlm_config(output_dir, tiny_vlm_dir, grid_data_dir), 4, monkeypatch)
    assert [c.step for c in list_checkpoints(output_dir)] == [3]
    opsd.train.train(vlm_config(output_dir, tiny_vlm_dir, grid_data_dir, "checkpoint.resume_from=auto"))
    assert_same_steps(read_metrics(output_dir), read_metrics(reference_dir))
    got, want = adapter_weights(output_dir / "checkpoint-6"), adapter_weights(reference_dir / "checkpoint-6")
    for role in want:
        assert got[role].keys() == want[role].keys()
        assert all(torch.equal(got[role][k], want[role][k]) for k in want[role]), role


def test_export_merge_loads_in_transformers_and_vllm(vlm_run, tmp_path, grid_data_dir):
    run_dir, student = vlm_run
    assert export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "adapter")]) == 0
    assert lora.is_adapter_dir(tmp_path / "adapter")
    out = tmp_path / "merged"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(out), "--merge"]) == 0
    processor = AutoProcessor.from_pretrained(out)
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert not any(".lora_" in n or "base_layer" in n for n in merged.state_dict())

    prompts, completions = sample_grid_eval_prompts(out, processor, grid_data_dir)
    from_student = trainer_logprobs(student, processor, prompts, completions)
    assert (engine_logprobs(completions) - from_student).abs().max() < TOLERANCE
    assert (trainer_logprobs(merged, processor, prompts, completions) - from_student).abs().max() < TOLERANCE


@pytest.mark.parametrize("sync, teacher", [("adapter", "base"), ("merged", "base"), ("merged", "ema")])
def test_text_model_trains_with_lora(sync, teacher, tmp_path, tiny_text_dir):
    cfg = text_config(tmp_path / "run", tiny_text_dir, tmp_path / "data", f"rollout.lora_sync={sync}",
                      f"teacher.mode={teacher}", "optim.warmup_steps=0")
    student = train_capturing_student(cfg)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["logprob_mismatch_max"] < 1e-3 for r in records)
    initial = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
    model_bytes = sum(p.numel() * p.element_size() for p in initial.parameters())
    adapter_bytes = sum(p.numel() * p.element_size() for p in lora.adapter_parameters(student).values())
    assert all(r["weight_sync_bytes"] == (adapter_bytes if sync == "adapter" else model_bytes) for r in records)
    assert_base_weights_unchanged(student, initial)

    # The base teacher, after training, scores exactly like the model the run started from.
    processor = AutoProcessor.from_pretrained(tiny_text_dir)
    prompts = [student_prompt(s, processor, cfg.prompts) for s in text_samples(2)]
    encoded = [encode_prompt(processor, p) for p in prompts]
    batch = collate(encoded, [[5, 6, 7, 8]] * len(encoded), processor.pad_token_id)
    with torch.no_grad():
        base = completion_logits(make_teacher(TeacherConfig(mode="base"), student).scorer, batch)
        assert torch.equal(base, completion_logits(initial, batch))
        assert (completion_logits(student, batch) - base).abs().max() > 1e-6  # the adapter did train
