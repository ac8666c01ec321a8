"""The run summary is built from the run's metrics records."""

import json

import pytest

from opsd.trainer.checkpoint import MANIFEST
from opsd.trainer.summary import format_summary, read_records, run_summary, write_summary


def test_summary_from_records(tmp_path):
    records = [
        {"step": 0, "eval/accuracy": 0.25, "time_eval_s": 1.0},
        {"step": 1, "loss": 0.5, "jsd": 0.5, "completion_tokens": 40, "time_rollout_s": 2.0, "time_train_s": 3.0,
         "time_weight_sync_s": 0.5},
        {"step": 2, "skipped_step": 1, "time_rollout_s": 1.0},
        {"step": 3, "loss": 0.25, "jsd": 0.25, "completion_tokens": 60, "time_rollout_s": 2.0, "time_train_s": 3.0,
         "time_weight_sync_s": 0.5, "eval/accuracy": 0.5, "time_eval_s": 1.0},
    ]
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / MANIFEST).write_text("{}")
    (tmp_path / "checkpoint-5").mkdir()  # no manifest: a save that did not finish
    summary = run_summary(records, output_dir=tmp_path, wall_time_s=20.0)
    assert summary["steps"] == 3 and summary["trained_steps"] == 2 and summary["skipped_steps"] == 1
    assert summary["stage_time_s"] == {"rollout": 5.0, "train": 6.0, "weight_sync": 1.0, "eval": 2.0, "other": 6.0}
    assert summary["completion_tokens"] == 100 and summary["tokens_per_s"] == 5.0
    assert summary["metrics"]["loss"] == {"first": 0.5, "first_step": 1, "last": 0.25, "last_step": 3}
    assert summary["metrics"]["eval/accuracy"] == {"first": 0.25, "first_step": 0, "last": 0.5, "last_step": 3}
    assert "eval/teacher_accuracy" not in summary["metrics"]
    assert summary["files"]["last_checkpoint"] == str(tmp_path / "checkpoint-3")
    text = format_summary(summary)
    assert "loss: 0.5 (step 1) -> 0.25 (step 3)" in text and "5.0 tokens/s" in text
    path = write_summary(tmp_path, summary)
    assert json.loads(path.read_text()) == summary


def test_resumed_run_times_its_own_steps_and_keeps_the_start(tmp_path):
    records = [{"step": s, "loss": 1.0 / s, "completion_tokens": 10, "time_train_s": 1.0} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "lo')
    read = read_records(tmp_path / "metrics.jsonl")
    assert read == records  # the torn last line of a crash is left out
    summary = run_summary(read, output_dir=tmp_path, wall_time_s=4.0, start_step=2)
    assert summary["trained_steps"] == 2 and summary["completion_tokens"] == 20
    assert summary["stage_time_s"]["train"] == 2.0
    assert summary["metrics"]["loss"]["first_step"] == 1 and summary["metrics"]["loss"]["last"] == pytest.approx(0.25)


def test_the_summary_says_what_moved_and_what_did_not():
    from opsd.trainer.summary import what_it_showed

    metrics = {
        "jsd": {"first": 0.4, "first_step": 1, "last": 0.1, "last_step": 20},
        "eval/accuracy": {"first": 0.0, "first_step": 0, "last": 0.0, "last_step": 20},
        "eval/teacher_accuracy": {"first": 0.25, "first_step": 0, "last": 0.5, "last_step": 20},
    }
    line = what_it_showed(metrics)
    assert "divergence (jsd) fell 75% from step 1 to 20" in line
    assert "student accuracy did not move (0 -> 0)" in line
    assert "teacher-prompt accuracy moved +25.0 points" in line
    assert "nothing to compare" in what_it_showed({})


def test_the_summary_says_how_retention_moved(tmp_path):
    records = [
        {"step": 0, "eval/accuracy": 0.0, "eval/retention_accuracy": 1.0, "eval/retention_nll": 3.125, "time_eval_s": 1.0},
        {"step": 5, "loss": 0.5, "jsd": 0.5, "eval/accuracy": 0.5, "eval/retention_accuracy": 0.875,
         "eval/retention_nll": 3.25, "time_eval_s": 1.0},
    ]
    summary = run_summary(records, output_dir=tmp_path, wall_time_s=5.0)
    assert summary["metrics"]["eval/retention_nll"] == {"first": 3.125, "first_step": 0, "last": 3.25, "last_step": 5}
    assert "retention (general questions) moved -12.5 points (1 -> 0.875)" in summary["showed"]
    assert "retention NLL of the held-out text rose 0.125 nats/token (3.125 -> 3.25" in summary["showed"]
    assert "eval/retention_accuracy: 1 (step 0) -> 0.875 (step 5)" in format_summary(summary)
