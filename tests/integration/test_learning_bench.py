"""bench/learning.py end to end on a tiny model: two steps per run, the report's shape and its PNG."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_step_runs_report_every_run_side_by_side(tmp_path):
    out = tmp_path / "learn"
    done = subprocess.run(
        [sys.executable, "bench/learning.py", "--runs", "opsd", "no_privileged", "noise", "sft", "--out", str(out),
         f"model.path={tmp_path / 'tiny-text'}", "model.build=tiny-text", "rollout.engine=hf",
         f"data.datasets.0.path={tmp_path / 'facts'}", "data.datasets.0.synthetic.n_facts=4",
         "data.datasets.0.synthetic.n_train=8", "data.datasets.0.synthetic.n_eval=8", "eval.num_samples=8",
         "train.max_steps=2", "eval.every=1", "train.prompts_per_micro_step=2", "rollout.max_new_tokens=6",
         "eval.max_new_tokens=6"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])  # the last JSON object on stdout
    assert report == json.loads((out / "report.json").read_text())
    assert set(report["runs"]) == {"opsd", "no_privileged", "noise", "sft"}
    for name, run in report["runs"].items():
        assert [e["step"] for e in run["eval"]] == [0, 1, 2], name
        for e in run["eval"]:
            assert 0 <= e["student_accuracy"] <= 1 and 0 <= e["teacher_accuracy"] <= 1
        assert run["steps"] == 2 and run["completion_tokens"] > 0
        assert run["student_gain"] == run["eval"][-1]["student_accuracy"] - run["eval"][0]["student_accuracy"]
        assert set(run["stage_s"]) >= {"rollout", "train", "weight_sync", "eval"}
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
    # No privileged information: the teacher's prompt is the student's, so both answer alike and the
    # divergence is 0 up to float rounding (nothing to learn from).
    control = report["runs"]["no_privileged"]
    assert all(e["student_accuracy"] == e["teacher_accuracy"] for e in control["eval"])
    assert max(control["distill_first_last"]) < 1e-6
    assert report["runs"]["sft"]["distill_first_last"] is None  # sft has no distillation term to log
    assert report["runs"]["opsd"]["distill_first_last"][0] > 1e-3
    assert {"opsd_gain_points", "opsd_gains_20_points", "no_privileged_moves_under_5_points",
            "under_30_minutes"} <= set(report["acceptance"])
    speed = report["speed"]
    assert speed["eval_items"] == 8 and set(speed["step_median"]) == {"rollout", "sequences", "score_backward_optimizer", "weight_sync"}
    # The step as it was (no prompt sharing) beside the step as it is, on the same sequences.
    assert set(speed["step_median_before"]) == set(speed["step_median"])
    assert speed["scoring_speedup_from_prompt_sharing"]["cpu_s"] > 0
    assert speed["evaluation"]["no_privileged_one_call"]["cpu_s"] > 0
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
