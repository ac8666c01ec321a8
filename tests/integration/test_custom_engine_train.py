"""A run with an engine named by import path: the weight-sync hook sees every parameter every step."""

import json

import pytest
import torch

from opsd.modeling import load_model, load_processor
from opsd.train import train
from tests.helpers.runs import demo_config, read_metrics

RECORDING_ENGINE = "tests.helpers.recording_engine:RecordingEngine"


@pytest.mark.slow
def test_custom_engine_hook_records_every_trainable_parameter_every_step(tmp_path, tiny_vlm_dir, grid_data_dir):
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, f"rollout.engine={RECORDING_ENGINE}", "rollout.sync_bucket_mb=0.5", "rollout.max_new_tokens=8")
    output_dir = train(cfg)
    metrics = read_metrics(output_dir)[1:]  # after the step-0 evaluation
    updates = [json.loads(line) for line in (output_dir / "weight_sync_record.jsonl").read_text().splitlines()]

    student = load_model(cfg.model, load_processor(cfg.model), torch.device("cpu"))
    trainable = {name: p.numel() * p.element_size() for name, p in student.named_parameters() if p.requires_grad}
    assert len(trainable) > 50
    # One update before the first step (the engine starts from the student's weights), one after each step.
    assert len(updates) == 1 + len(metrics) == 1 + cfg.train.max_steps
    for update in updates:
        assert update["tensors"] == trainable  # every trainable parameter, with its full size
        assert update["buckets"] > 1  # 0.5 MB buckets split the model
    for step, update in zip(metrics, updates[1:]):
        assert step["weight_sync_bytes"] == sum(update["tensors"].values())
        # The wrapped engine got the weights: it samples with what the trainer scores with.
        assert step["logprob_mismatch_max"] < 1e-3


def test_an_engine_that_samples_from_another_prompt_is_called_off_policy(tmp_path, tiny_vlm_dir, grid_data_dir, capsys):
    """The engine samples each prompt's completions from the next prompt: the trainer's logprobs of
    those tokens under their own prompt differ by far more than the float32 threshold, every step."""
    from opsd.trainer.metrics import MISMATCH_PATIENCE, MISMATCH_THRESHOLD

    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, "rollout.engine=tests.helpers.odd_engines:OtherPromptEngine",
                      "rollout.max_new_tokens=8", "eval.every=0", f"train.max_steps={MISMATCH_PATIENCE}")
    output_dir = train(cfg)
    records = read_metrics(output_dir)
    assert all(r["logprob_mismatch_mean"] > MISMATCH_THRESHOLD["float32"] for r in records)
    out = capsys.readouterr().out
    warning = "WARNING: the engine's samples are not the student's: logprob_mismatch_mean stayed above 0.01 for 3 steps"
    assert out.count(warning) == 2  # once when it shows, once in the summary
    summary = json.loads((output_dir / "summary.json").read_text())
    assert len(summary["warnings"]) == 1 and summary["warnings"][0].startswith(warning)
