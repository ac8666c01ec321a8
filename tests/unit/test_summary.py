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


def test_the_summary_holds_held_out_accuracy_at_step_0_and_the_end_beside_the_teacher_prompts(tmp_path):
    records = [
        {"step": 0, "eval/accuracy": 0.0, "eval/teacher_accuracy": 0.71875, "eval/num_samples": 64},
        {"step": 4, "loss": 0.3, "eval/accuracy": 0.125, "eval/teacher_accuracy": 0.6, "eval/num_samples": 64},
        {"step": 8, "loss": 0.2, "eval/accuracy": 0.234375, "eval/teacher_accuracy": 0.546875, "eval/num_samples": 64},
    ]
    summary = run_summary(records, output_dir=tmp_path, wall_time_s=10.0, see_also="make learn: the controls")
    held_out = json.loads(write_summary(tmp_path, summary).read_text())["held_out_accuracy"]
    assert held_out["items"] == 64 and held_out["student"]["gain_points"] == 23.44
    assert (held_out["student"]["first"], held_out["student"]["first_step"]) == (0.0, 0)
    assert (held_out["student"]["last"], held_out["student"]["last_step"]) == (0.234375, 8)
    assert held_out["teacher_prompt"]["first"] == 0.71875
    lines = format_summary(summary).splitlines()
    assert lines[2] == ("  held-out accuracy (64 questions, greedy): student 0.0% at step 0 -> 23.4% at step 8 "
                        "(+23.4 points); with the teacher's prompt 71.9% at step 0, 54.7% at step 8")
    assert lines[-1] == "  see also: make learn: the controls"
    one_eval = run_summary(records[:1], output_dir=tmp_path, wall_time_s=1.0)
    assert one_eval["held_out_accuracy"] is None and "held-out" not in format_summary(one_eval)


def mismatch_records(values, start=1):
    return [{"step": start + i, "loss": 0.1, "logprob_mismatch_mean": v} for i, v in enumerate(values)]


@pytest.mark.parametrize("dtype, values, warns", [
    ("float32", [1e-6, 1e-6, 1e-6], False),
    ("float32", [0.5, 0.4, 0.6], True),
    ("float32", [0.5, 1e-6, 0.6], False),  # not for 3 steps in a row
    ("float32", [0.5, 0.6], False),  # too few steps to say
    ("bfloat16", [0.03, 0.05, 0.04], False),  # bfloat16's own rounding
    ("bfloat16", [0.5, 0.4, 0.6], True),
])
def test_samples_that_are_not_the_students_are_called_so(dtype, values, warns, tmp_path):
    from opsd.config import config_from_dict
    from opsd.trainer.metrics import RecordWatch, mismatch_threshold, off_policy_warning

    threshold = mismatch_threshold(config_from_dict({"model": {"path": "m", "dtype": dtype}, "data": {"path": "d"}}))
    records = mismatch_records(values)
    assert (off_policy_warning(records, threshold) is not None) == warns
    watch = RecordWatch(threshold)
    lines = [line for r in records for line in watch.lines(r)]
    assert len(lines) == int(warns) and all("the engine's samples are not the student's" in line for line in lines)
    summary = run_summary(records, output_dir=tmp_path, wall_time_s=1.0, mismatch_threshold=threshold)
    assert len(summary["warnings"]) == int(warns)


def test_no_mismatch_check_where_nothing_is_sampled_or_scores_are_noisy():
    from opsd.config import config_from_dict
    from opsd.trainer.metrics import mismatch_threshold

    def cfg(**sections):
        return config_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, **sections})

    assert mismatch_threshold(cfg(loss={"kind": "sft", "ce_weight": 1.0}, prompts={"privileged": ["text"]})) is None
    assert mismatch_threshold(cfg(model={"path": "m", "lora": {"dropout": 0.1}})) is None


def test_skipped_rows_are_said_when_they_grow_and_summed_up_at_the_end(tmp_path):
    from opsd.trainer.metrics import RecordWatch

    records = [{"step": 1, "data/skipped_corrupt_image": 1}, {"step": 2, "data/skipped_corrupt_image": 1},
               {"step": 3, "data/skipped_corrupt_image": 2, "data/skipped_empty_question": 1}]
    watch = RecordWatch()
    lines = [watch.lines(r) for r in records]
    assert lines[0] == ["data: bad rows skipped so far: 1 (corrupt_image 1) (data/skipped_* in metrics.jsonl; "
                        "data.on_bad_sample=error stops at the first)"]
    assert lines[1] == [] and "3 (corrupt_image 2, empty_question 1)" in lines[2][0]
    summary = run_summary(records, output_dir=tmp_path, wall_time_s=1.0)
    assert summary["skipped_rows"] == {"corrupt_image": 2, "empty_question": 1}
    assert "  bad rows skipped: 3 (corrupt_image 2, empty_question 1)" in format_summary(summary)


def test_a_stopped_run_says_so(tmp_path):
    stopped = {"signal": "SIGTERM", "step": 4, "checkpoint": "checkpoint-4", "seconds_since_signal": 2.5}
    summary = run_summary(mismatch_records([1e-6]), output_dir=tmp_path, wall_time_s=1.0, stopped=stopped)
    assert summary["stopped"] == stopped
    assert format_summary(summary).startswith("run summary (stopped by SIGTERM): step 1 ")


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
