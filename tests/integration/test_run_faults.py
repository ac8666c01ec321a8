"""Faults a long run meets, in short runs of the tiny VLM (vLLM engine): a loss that turns NaN,
a second run in the same output directory, resumed settings (docs/faults.md)."""

import math

import pytest
from safetensors.torch import load_file

import opsd.train
from opsd.trainer.checkpoint import list_checkpoints
from opsd.trainer.step import NonFiniteStepsError
from tests.helpers.runs import demo_config, read_metrics


@pytest.mark.vllm
@pytest.mark.slow
def test_a_loss_that_turns_nan_is_not_trained_on_and_stops_the_run_with_a_finite_checkpoint(tmp_path, tiny_vlm_dir, grid_data_dir):
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, "optim.lr=1e30", "optim.warmup_steps=1", "train.max_steps=6",
                      "train.max_bad_steps=2", "checkpoint.save_every=0", "eval.every=0", "checkpoint.resume_from=null")
    with pytest.raises(NonFiniteStepsError, match=r"train.max_bad_steps=2 in a row stops the run\. checkpoint-(\d+) holds"):
        opsd.train.train(cfg)
    records = read_metrics(tmp_path / "run")
    bad = [r["step"] for r in records if r.get("nonfinite_step")]
    assert len(bad) == 2 and bad == [records[-1]["step"] - 1, records[-1]["step"]], records
    assert not any(r.get("nonfinite_step") for r in records[:-2])
    [saved] = list_checkpoints(tmp_path / "run")
    assert saved.step == bad[-1]
    weights = load_file(saved.path / "model" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())  # never a NaN checkpoint
    assert all(math.isfinite(r["loss"]) for r in records[:-2])
