"""bench/learning.py's report from metrics records: retention at step 0 and at the end of every run,
opsd beside sft at equal steps, training time and accuracy, the acceptance keys."""

from pathlib import Path

import pytest

from tests.helpers.bench import load_bench


@pytest.fixture(scope="module")
def learning():
    return load_bench("learning", "bench_learning")


def records(accuracies: dict[int, float], retention: dict[int, tuple[float, float]], step_s: float) -> list[dict]:
    """A run's metrics.jsonl: a trained step every step, evaluations (with retention) where given."""
    out = []
    for step in range(max(accuracies) + 1):
        r = {"step": step}
        if step:
            r.update(loss=0.1, jsd=0.1, ce=1.0, completion_tokens=10, time_rollout_s=step_s / 2,
                     time_train_s=step_s / 2, time_weight_sync_s=0.0)
        if step in accuracies:
            accuracy, nll = retention[step]
            r.update({"eval/accuracy": accuracies[step], "eval/answered": 1.0, "eval/retention_accuracy": accuracy,
                      "eval/retention_nll": nll, "time_eval_s": 1.0, "time_retention_s": 0.25})
        out.append(r)
    return out


def runs(learning, opsd_accuracies):
    sft = records({0: 0.0, 5: 0.5, 10: 0.8}, {0: (1.0, 3.0), 5: (0.9, 3.2), 10: (0.75, 3.5)}, step_s=2.0)
    opsd = records(opsd_accuracies, {s: (1.0, 3.0 + s / 100) for s in opsd_accuracies}, step_s=4.0)
    control = records({0: 0.0, 5: 0.03, 10: 0.0}, {0: (1.0, 3.0), 5: (1.0, 3.0), 10: (1.0, 3.0)}, step_s=4.0)
    return {name: learning.summarise(r, 100.0, 200.0)
            for name, r in (("opsd", opsd), ("no_privileged", control), ("noise", control), ("sft", sft))}


def test_every_run_reports_retention_at_step_0_and_at_the_end(learning):
    report = runs(learning, {0: 0.0, 5: 0.2, 10: 0.4, 15: 0.6, 20: 0.75, 25: 0.8})
    sft = report["sft"]["retention"]
    assert sft["step_0"] == {"step": 0, "accuracy": 1.0, "nll": 3.0}
    assert sft["end"] == {"step": 10, "accuracy": 0.75, "nll": 3.5}
    assert sft["change"] == {"accuracy_points": -25.0, "nll": pytest.approx(0.5)}
    assert report["opsd"]["retention"]["end"]["step"] == 25
    assert [e["train_s"] for e in report["sft"]["eval"]] == [0.0, 10.0, 20.0]  # training stages only


def test_opsd_beside_sft_at_equal_steps_training_time_and_accuracy(learning):
    report = runs(learning, {0: 0.0, 5: 0.2, 10: 0.4, 15: 0.6, 20: 0.75, 25: 0.8})
    comparison = learning.opsd_vs_sft(report, steps=10)
    assert comparison["target_accuracy"] == pytest.approx(0.7)
    assert comparison["equal_steps"]["opsd"]["step"] == 10 and comparison["equal_steps"]["sft"]["step"] == 10
    # sft trained 20 s in its 10 steps; opsd (4 s a step) had done 5 steps by then.
    assert comparison["equal_training_time"]["opsd"]["step"] == 5 and comparison["equal_training_time"]["opsd_next"]["step"] == 10
    equal = comparison["equal_accuracy"]["opsd"]
    assert comparison["opsd_within_points"] and equal["step"] == 20 and equal["retention_nll"] == pytest.approx(3.2)
    accept = learning.text_facts_acceptance(report, 10, comparison)
    assert accept["opsd_gain_points"] == 40.0 and accept["opsd_gains_20_points"]
    assert accept["opsd_end_gain_points"] == 80.0 and accept["sft_gain_points"] == 80.0
    assert accept["no_privileged_moves_under_5_points"] and accept["noise_moves_under_5_points"]
    assert accept["opsd_within_10_points_of_sft"]


def test_opsd_short_of_sft_says_how_close_it_got(learning):
    report = runs(learning, {0: 0.0, 5: 0.2, 10: 0.4, 15: 0.55, 20: 0.5})
    comparison = learning.opsd_vs_sft(report, steps=10)
    assert not comparison["opsd_within_points"] and comparison["equal_accuracy"]["opsd"] is None
    assert comparison["equal_accuracy"]["opsd_closest"]["step"] == 15
    assert "best 55.0% at step 15, 15.0 points short of the 70.0% target" in comparison["note"]
    assert not learning.text_facts_acceptance(report, 10, comparison)["opsd_within_10_points_of_sft"]


def test_the_report_holds_each_task_with_every_runs_retention_and_the_comparison(learning, tmp_path, capsys):
    """bench/learning.py end to end on runs already done (`--keep`): no training, the whole report."""
    import json

    out = tmp_path / "learn"
    sft = records({0: 0.0, 5: 0.5, 10: 0.8}, {0: (1.0, 3.0), 5: (0.9, 3.2), 10: (0.75, 3.5)}, step_s=2.0)
    opsd = records({0: 0.0, 5: 0.2, 10: 0.4, 15: 0.6, 20: 0.75}, {s: (1.0, 3.0 + s / 100) for s in range(0, 25, 5)}, step_s=4.0)
    control = records({0: 0.0, 5: 0.03, 10: 0.0}, {0: (1.0, 3.0), 5: (1.0, 3.0), 10: (0.5, 3.0)}, step_s=4.0)
    taught = records({0: 0.0, 5: 0.3, 10: 0.5}, {s: (0.9, 3.0) for s in (0, 5, 10)}, step_s=4.0)
    for name, run in (("opsd", opsd), ("no_privileged", control), ("noise", control), ("sft", sft), ("model_teacher", taught)):
        (out / "text_facts" / name).mkdir(parents=True)
        (out / "text_facts" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run))
    assert learning.main(["--tasks", "text_facts", "--keep", "--opsd-steps", "20", "--out", str(out), "model.build=null"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # printed last
    assert report == json.loads((out / "report.json").read_text())
    task = report["tasks"]["text_facts"]
    assert task == json.loads((out / "text_facts" / "report.json").read_text())  # the task's own section
    assert report["runs"] == task["runs"] and list(task["runs"]) == ["opsd", "no_privileged", "noise", "sft", "model_teacher"]
    assert task["steps"] == 10 and task["opsd_steps"] == 20
    for name, run in task["runs"].items():
        end = 20 if name == "opsd" else 10
        assert run["reused"] and run["steps"] == end
        assert run["retention"]["step_0"]["step"] == 0 and run["retention"]["end"]["step"] == end
    assert task["runs"]["noise"]["retention"]["change"] == {"accuracy_points": -50.0, "nll": 0.0}
    comparison = task["opsd_vs_sft"]
    assert comparison["equal_accuracy"]["opsd"]["step"] == 20 and comparison["equal_accuracy"]["sft"]["step"] == 10
    assert comparison["equal_steps"]["opsd"]["retention_nll"] == pytest.approx(3.1)
    assert report["acceptance"]["text_facts.opsd_within_10_points_of_sft"] is True
    assert report["acceptance"]["text_facts.opsd_gain_points"] == 40.0
    assert report["acceptance"]["text_facts.model_teacher_gains_20_points"] is True  # sft's model taught it 50 points
    assert task["runs"]["model_teacher"]["overrides"] == [
        "prompts.privileged=[]", f"teacher={{mode: model, path: {out / 'text_facts' / 'sft' / 'checkpoint-10' / 'model'}}}"]
    # Reused runs count with their stages' seconds (opsd 20 x 4 s + 5 evaluations, sft 10 x 2 s + 3, ...).
    assert report["total_wall_s"] >= 85 + 23 + 2 * 43
    assert Path(task["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_visual_acceptance_asks_15_points_controls_within_5_and_a_30_point_teacher(learning):
    report = runs(learning, {0: 0.0, 5: 0.05, 10: 0.1, 15: 0.15, 20: 0.2})  # opsd 20 steps, the others 10
    for run in report.values():
        run["eval"][0]["teacher_accuracy"] = 0.5
    accepted = learning.visual_acceptance(report, steps=10, comparison=None)
    # opsd's gain counts to its last evaluation; at the controls' length it is reported beside.
    assert accepted["opsd_gain_points"] == 20.0 and accepted["opsd_gains_15_points"]
    assert accepted["opsd_gain_points_at_10"] == 10.0
    assert accepted["teacher_gap_step_0_points"] == 50.0 and accepted["teacher_30_points_above_student_at_step_0"]
    assert accepted["noise_moves_under_5_points"] and accepted["no_privileged_moves_under_5_points"]
    report = {**report, "opsd": learning.summarise(records({0: 0.0, 10: 0.1}, {0: (1, 3), 10: (1, 3)}, 1.0), 1.0, 1.0)}
    report["opsd"]["eval"][0]["teacher_accuracy"] = 0.25
    report["noise"] = learning.summarise(records({0: 0.0, 10: 0.0625}, {0: (1, 3), 10: (1, 3)}, 1.0), 1.0, 1.0)
    accepted = learning.visual_acceptance(report, steps=10, comparison=None)
    assert not accepted["opsd_gains_15_points"] and not accepted["teacher_30_points_above_student_at_step_0"]
    assert not accepted["noise_moves_under_5_points"] and accepted["no_privileged_moves_under_5_points"]
