"""Short end-to-end runs of `python -m opsd.train` on the tiny VLM and synthetic data."""

import math

import pytest

from opsd.train import main, train
from tests.helpers.runs import demo_config, read_metrics

REQUIRED_KEYS = {
    "step", "loss", "jsd", "ce", "lr", "grad_norm", "completion_len", "completion_tokens",
    "time_rollout_s", "time_train_s", "time_weight_sync_s", "logprob_mismatch_max", "logprob_mismatch_mean",
}


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_config_trains_with_vllm(tmp_path, tiny_vlm_dir, grid_data_dir):
    records = read_metrics(train(demo_config(tmp_path, tiny_vlm_dir, grid_data_dir)))
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert REQUIRED_KEYS <= r.keys()
        assert math.isfinite(r["loss"]) and r["completion_tokens"] > 0
        # The engine sampled with exactly the weights the trainer scored with.
        assert r["logprob_mismatch_max"] < 1e-3
    assert records[1]["lr"] > 0 and records[1]["grad_norm"] > 0


@pytest.mark.slow
def test_demo_config_trains_with_hf_engine_and_tinker_loss(tmp_path, tiny_vlm_dir, grid_data_dir):
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, "rollout.engine=hf", "loss.kind=tinker", "teacher.mode=fixed")
    records = read_metrics(train(cfg))
    assert len(records) == 3
    assert all(math.isfinite(r["loss"]) and r["logprob_mismatch_max"] < 1e-3 for r in records)


@pytest.mark.vllm
@pytest.mark.slow
def test_stale_engine_is_caught_by_the_mismatch_check(tmp_path, tiny_vlm_dir, grid_data_dir, monkeypatch):
    """Without the weight sync the engine samples from old weights, and the metric shows it."""
    from opsd.rollout.vllm_engine import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "receive_weights", lambda self, bucket: None)
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, "optim.warmup_steps=0", "optim.schedule=constant")
    records = read_metrics(train(cfg))
    assert records[0]["logprob_mismatch_max"] < 1e-3
    assert records[-1]["logprob_mismatch_max"] > 1e-2


@pytest.mark.slow
def test_cli_entry_point(tmp_path, tiny_vlm_dir, grid_data_dir):
    args = [
        "--config", "configs/demo.yaml", f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}",
        f"logging.output_dir={tmp_path / 'cli'}", "train.max_steps=1", "rollout.engine=hf",
        "rollout.max_new_tokens=8", "logging.progress_bar=false",
    ]
    assert main(args) == 0
    assert len(read_metrics(tmp_path / "cli")) == 1
