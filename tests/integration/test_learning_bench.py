"""bench/learning.py end to end on tiny models: two steps per run, the report's shape and its PNGs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_step_runs_of_two_tasks_report_every_run_side_by_side(tmp_path, tiny_vlm_dir):
    """One benchmark run of the text task (four runs and the step profile) and the visual task (two runs)."""
    out = tmp_path / "learn"
    done = subprocess.run(
        [sys.executable, "bench/learning.py", "--tasks", "text_facts", "visual", "--runs", "opsd", "no_privileged", "noise", "sft",
         "--opsd-steps", "3", "--visual-runs", "opsd", "noise", "--visual-opsd-steps", "2",
         "--profile-steps", "2", "--out", str(out),
         f"model.path={tmp_path / 'tiny-text'}", "model.build=tiny-text", "rollout.engine=hf",
         f"data.datasets.0.path={tmp_path / 'facts'}", "data.datasets.0.synthetic.n_facts=4",
         "data.datasets.0.synthetic.n_train=8", "data.datasets.0.synthetic.n_eval=8", "eval.num_samples=8",
         "train.max_steps=2", "eval.every=1", "train.prompts_per_micro_step=2", "rollout.max_new_tokens=6",
         "eval.max_new_tokens=6", "eval.retention.text_tokens=64", "eval.retention.chunk_tokens=32",
         "eval.retention.max_new_tokens=4",
         "--visual-overrides",
         f"model.path={tiny_vlm_dir}", "model.build=tiny-vlm", "rollout.engine=hf",
         f"data.datasets.0.path={tmp_path / 'picture-facts'}", "data.datasets.0.synthetic.n_facts=4",
         "data.datasets.0.synthetic.n_train=8", "data.datasets.0.synthetic.n_eval=8", "eval.num_samples=8",
         "train.max_steps=1", "eval.every=1", "train.prompts_per_micro_step=2", "rollout.max_new_tokens=4",
         "eval.max_new_tokens=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])  # the last JSON object on stdout
    assert report == json.loads((out / "report.json").read_text())
    task = report["tasks"]["text_facts"]
    assert report["runs"] == task["runs"]  # where they were before tasks
    assert set(report["runs"]) == {"opsd", "no_privileged", "noise", "sft"}
    for name, run in report["runs"].items():
        steps = [0, 1, 2, 3] if name == "opsd" else [0, 1, 2]
        assert [e["step"] for e in run["eval"]] == steps, name
        for e in run["eval"]:
            assert 0 <= e["student_accuracy"] <= 1 and 0 <= e["teacher_accuracy"] <= 1
            assert 0 <= e["retention_accuracy"] <= 1 and e["retention_nll"] > 0 and e["retention_seconds"] > 0
        assert run["retention"]["step_0"]["step"] == 0 and run["retention"]["end"]["step"] == steps[-1]
        assert set(run["retention"]["change"]) == {"accuracy_points", "nll"}
        assert run["steps"] == steps[-1] and run["completion_tokens"] > 0
        assert run["student_gain"] == run["eval"][-1]["student_accuracy"] - run["eval"][0]["student_accuracy"]
        assert set(run["stage_s"]) >= {"rollout", "train", "weight_sync", "eval"}
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
    # Every run starts from the same weights: the same retention at step 0.
    assert len({json.dumps(run["retention"]["step_0"]) for run in report["runs"].values()}) == 1
    # Training moved the weights, and the text probe with them.
    assert report["runs"]["sft"]["retention"]["change"]["nll"] != 0
    # No privileged information: the teacher's prompt is the student's, so both answer alike and the
    # divergence is 0 up to float rounding (nothing to learn from).
    control = report["runs"]["no_privileged"]
    assert all(e["student_accuracy"] == e["teacher_accuracy"] for e in control["eval"])
    assert max(control["distill_first_last"]) < 1e-6
    assert report["runs"]["sft"]["distill_first_last"] is None  # sft has no distillation term to log
    assert report["runs"]["opsd"]["distill_first_last"][0] > 1e-3
    comparison = task["opsd_vs_sft"]
    assert comparison["equal_steps"]["opsd"]["step"] == 2 and comparison["sft_end"]["step"] == 2
    assert comparison["equal_accuracy"]["opsd"] is not None or "note" in comparison
    assert {"text_facts.opsd_gain_points", "text_facts.opsd_gains_20_points", "text_facts.noise_moves_under_5_points",
            "text_facts.no_privileged_moves_under_5_points", "text_facts.opsd_within_10_points_of_sft",
            "under_42_minutes"} <= set(report["acceptance"])
    # The run's own summary says how retention moved.
    summary = json.loads((out / "text_facts" / "opsd" / "summary.json").read_text())
    assert {"eval/retention_nll", "eval/retention_accuracy"} <= set(summary["metrics"])
    assert "retention NLL of the held-out text" in summary["showed"]
    speed = report["speed"]  # bench/step_profile.py --config: the recipe's stage against its floor, in parts
    (profiled,) = speed["settings"]
    assert profiled["name"] == "config" and profiled["steps"] == 2
    assert profiled["stage_s"] > 0 and profiled["floor_s"] > 0 and profiled["stage_over_floor"] > 0
    assert {"sequences", "optimizer"} <= set(profiled["parts"])
    assert abs(profiled["unaccounted_s"]) <= max(0.05 * profiled["stage_s"], 0.15)  # the parts are the stage
    assert "rollout_over_direct_vllm" not in profiled  # the HF engine: no vLLM of its own to call directly
    assert Path(task["png"]) == out / "text_facts" / "learning_curve.png"
    assert Path(task["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The visual task, beside it in the same report, has the text task's shape.
    task = report["tasks"]["visual"]
    assert set(task["runs"]) == {"opsd", "noise"}
    for name, run in task["runs"].items():
        assert [e["step"] for e in run["eval"]] == ([0, 1, 2] if name == "opsd" else [0, 1]), name
        assert all(0 <= e["student_accuracy"] <= 1 and 0 <= e["teacher_accuracy"] <= 1 for e in run["eval"])
    assert task["vlm_build"]["skipped"]  # the tiny model is built by the recipe, not timed apart
    assert task["opsd_steps"] == 2 and "opsd_gain_points_at_1" in task["acceptance"]
    assert "visual.under_25_minutes" in report["acceptance"]
    assert {"visual.opsd_gains_15_points", "visual.teacher_30_points_above_student_at_step_0",
            "visual.noise_moves_under_5_points"} <= set(report["acceptance"])
    assert "visual.no_privileged_moves_under_5_points" not in report["acceptance"]  # a run not asked for
    assert Path(task["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
