"""Short training runs of the demo config on the tiny models, and their metrics."""

import json

from opsd.config import load_config


def demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, *overrides):
    return load_config("configs/smoke.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
        "logging.progress_bar=false", "train.max_steps=3", "rollout.max_new_tokens=16", *overrides,
    ])


def read_metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


class Interrupted(Exception):
    """Raised out of a training run by `train_until_crash`."""


def train_until_crash(cfg, crash_after_step: int, monkeypatch) -> None:
    """`opsd.train.train(cfg)`, stopped by an exception right after `crash_after_step` is logged (as a
    crash would stop it: no end of run, no save; the error path closes the engine and metrics file)."""
    import pytest

    import opsd.train
    from opsd.trainer.metrics import MetricsLogger

    log = MetricsLogger.log

    def log_then_crash(self, step, metrics):
        log(self, step, metrics)
        if step == crash_after_step:
            raise Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log", log_then_crash)
        with pytest.raises(Interrupted):
            opsd.train.train(cfg)


def assert_same_steps(records, reference):
    """Every logged value of every step agrees (wall times aside) to 1e-6."""
    import pytest

    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference):
        for key, value in want.items():
            if not key.startswith("time_"):
                assert got[key] == pytest.approx(value, abs=1e-6, rel=0), (got["step"], key)
