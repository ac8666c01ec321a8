"""A model teacher in real runs: the tiny VLM taught by a deeper, wider tiny VLM with the same
tokenizer and processor (`teacher.mode: model`), sampled with the vLLM engine.

6 steps straight: the engine follows the student (the teacher never reaches it: each sync carries
the student's bytes alone), the teacher's weights stay bit for bit as loaded and the optimizer holds
no state of them; the checkpoints record the teacher's path and fingerprint and hold none of its
weights. 3 steps, a crash, a resume and 3 more equal the 6 straight ones."""

import json

import pytest
import torch
from safetensors.torch import load_file

import opsd.train
from opsd.config import load_config
from opsd.trainer.checkpoint import list_checkpoints
from tests.helpers.runs import assert_same_steps, read_metrics, train_until_crash


def model_teacher_config(output_dir, tiny_vlm_dir, tiny_vlm_large_dir, grid_data_dir, *extra):
    return load_config("configs/demo.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={output_dir}",
        "logging.progress_bar=false", "rollout.max_new_tokens=12", "train.max_steps=6", "checkpoint.save_every=3",
        "checkpoint.resume_from=null", "checkpoint.save_total_limit=null", "eval.every=0",
        f"teacher={{mode: model, path: {tiny_vlm_large_dir}}}", *extra,
    ])


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_vlm_dir, tiny_vlm_large_dir, grid_data_dir):
    """6 steps without interruption; keeps the run's student, teacher and optimizer."""
    output_dir = tmp_path_factory.mktemp("model-teacher") / "run"
    captured = {}
    start_run = opsd.train.start_run

    def capture(cfg, log_file):
        captured["run"] = start_run(cfg, log_file)
        return captured["run"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opsd.train, "start_run", capture)
        opsd.train.train(model_teacher_config(output_dir, tiny_vlm_dir, tiny_vlm_large_dir, grid_data_dir))
    return output_dir, captured["run"]


@pytest.mark.vllm
def test_a_larger_model_teaches_and_stays_as_loaded(straight_run, tiny_vlm_large_dir):
    output_dir, run = straight_run
    records = [r for r in read_metrics(output_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["jsd"] > 0 for r in records)  # another model: the divergence does not start at 0
    assert max(r["logprob_mismatch_max"] for r in records) < 1e-4  # the engine got every step's student
    student, teacher = run.student, run.teacher.module
    student_bytes = sum(p.numel() * p.element_size() for p in student.parameters())
    assert all(r["weight_sync_bytes"] == student_bytes for r in records)  # the student's bytes, no teacher's
    assert sum(p.numel() for p in teacher.parameters()) > 1.5 * sum(p.numel() for p in student.parameters())

    loaded = load_file(tiny_vlm_large_dir / "model.safetensors")
    state = teacher.state_dict()
    assert loaded.keys() <= state.keys() and all(torch.equal(state[k], loaded[k]) for k in loaded)  # bit for bit
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    teacher_ids = {id(p) for p in teacher.parameters()}
    optimized = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert not teacher_ids & {id(p) for p in optimized} and not teacher_ids & {id(p) for p in run.optimizer.state}
    assert len(run.optimizer.state) == sum(p.requires_grad for p in student.parameters())

    for checkpoint in list_checkpoints(output_dir):
        manifest = json.loads((checkpoint.path / "opsd_checkpoint.json").read_text())
        assert manifest["teacher_mode"] == "model" and manifest["teacher"]["path"] == str(tiny_vlm_large_dir)
        assert manifest["teacher"]["fingerprint"] == run.teacher.fingerprint
        assert not (checkpoint.path / "teacher").exists()
        assert not any(name.startswith("train_state/") and "teacher" in name for name in manifest["files"])


@pytest.mark.vllm
@pytest.mark.slow
def test_resume_with_a_model_teacher_continues_exactly(straight_run, tmp_path, tiny_vlm_dir, tiny_vlm_large_dir,
                                                       grid_data_dir, monkeypatch):
    """6 steps straight == 3 steps, a crash one step after checkpoint-3, a resume, 3 more steps."""
    reference_dir, _ = straight_run
    output_dir = tmp_path / "run"
    config = lambda *extra: model_teacher_config(output_dir, tiny_vlm_dir, tiny_vlm_large_dir, grid_data_dir, *extra)  # noqa: E731
    train_until_crash(config(), 4, monkeypatch)
    assert [c.step for c in list_checkpoints(output_dir)] == [3]
    opsd.train.train(config("checkpoint.resume_from=auto"))
    assert_same_steps(read_metrics(output_dir), read_metrics(reference_dir))
    final = [load_file(d / "checkpoint-6" / "model" / "model.safetensors") for d in (output_dir, reference_dir)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
