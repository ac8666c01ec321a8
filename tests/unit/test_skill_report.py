"""bench/learning.py's skill task report from metrics records: per-seed gains beside the accuracies
and how many answers moved, mean and min-max, tokens to reach the stated accuracy, opsd beside grpo at equal tokens and at equal steps, acceptance."""

from pathlib import Path

import pytest

from tests.helpers.bench import load_bench


@pytest.fixture(scope="module")
def learning():
    return load_bench("learning", "bench_learning_skill")


def records(accuracies: dict[int, float], tokens_per_step: int) -> list[dict]:
    out = []
    for step in range(max(accuracies) + 1):
        r = {"step": step}
        if step:
            r.update(loss=0.1, jsd=0.1, ce=1.0, completion_tokens=tokens_per_step, time_rollout_s=1.0, time_train_s=1.0,
                     time_weight_sync_s=0.0, **{"reward/mean": accuracies.get(step, 0.0)})
        if step in accuracies:
            r.update({"eval/accuracy": accuracies[step], "eval/answered": 1.0, "eval/teacher_accuracy": 0.9, "time_eval_s": 1.0})
        out.append(r)
    return out


def eval_records(run_dir: Path, step: int, answers: dict[str, str | None]) -> None:
    """A run's evaluation records at `step` (opsd/evaluation.py's format): the student's answer per
    item, and a teacher's record that the answers' count must leave out."""
    from opsd.evaluation import eval_file, write_records

    rows = [{"id": item, "role": "student", "completion": f"It is {a}.", "answer": a, "reference": "1", "correct": a == "one"}
            for item, a in answers.items()]
    write_records(eval_file(run_dir, step), rows + [{"id": "a", "role": "teacher", "answer": "nine"}])


def test_answers_moved_counts_the_items_whose_normalised_answer_changed(learning, tmp_path):
    """"seven" then "7" is the same answer; no answer counts as its own; the teacher's records are not the student's."""
    eval_records(tmp_path, 0, {"a": "one", "b": "seven", "c": None, "d": "one"})
    eval_records(tmp_path, 10, {"a": "two", "b": "7", "c": "two", "d": "one"})
    moved = learning.answers_moved(tmp_path, 0, 10)
    assert moved["changed"] == 2 and moved["items"] == 4
    assert moved["first"] == {"step": 0, "counts": {"1": 2, "7": 1, "(none)": 1}}
    assert moved["last"] == {"step": 10, "counts": {"2": 2, "7": 1, "1": 1}}


def seed(learning, number, accuracies, tokens_per_step):
    evals = learning.skill_points(records(accuracies, tokens_per_step))
    return {"seed": number, "student_gain": evals[-1]["student_accuracy"] - evals[0]["student_accuracy"], "eval": evals,
            "completion_tokens": evals[-1]["completion_tokens"], "wall_s": 10.0, "cpu_s": 20.0}


def test_the_skill_report_holds_seeds_spreads_tokens_to_target_and_the_opsd_grpo_comparisons(learning, tmp_path):
    runs = {
        "opsd": learning.skill_run_summary([seed(learning, 0, {0: 0.1, 5: 0.3, 10: 0.4}, 10),
                                            seed(learning, 1, {0: 0.1, 5: 0.2, 10: 0.3}, 12)]),
        "grpo": learning.skill_run_summary([seed(learning, 0, {0: 0.1, 5: 0.15, 10: 0.2}, 20),
                                            seed(learning, 1, {0: 0.1, 5: 0.1, 10: 0.1}, 20)]),
        "noise": learning.skill_run_summary([seed(learning, 0, {0: 0.1, 5: 0.12, 10: 0.13}, 10)]),
    }
    opsd = runs["opsd"]
    assert [s["student_gain"] for s in opsd["seeds"]] == pytest.approx([0.3, 0.2])
    assert opsd["student_gain"] == pytest.approx({"mean": 0.25, "min": 0.2, "max": 0.3})
    assert [e["completion_tokens"] for e in opsd["seeds"][1]["eval"]] == [0, 60, 120]
    assert opsd["curve"][1]["student_accuracy"] == pytest.approx({"mean": 0.25, "min": 0.2, "max": 0.3})
    reached = learning.tokens_to_reach(runs, 0.2)
    assert [(s["reached"], s["completion_tokens"]) for s in reached["opsd"]] == [(True, 50), (True, 60)]
    assert [(s["reached"], s["completion_tokens"], s["best_accuracy"]) for s in reached["grpo"]] == [(True, 200, 0.2), (False, None, 0.1)]
    equal = learning.opsd_vs_grpo(runs)
    assert equal["completion_tokens"] == 110  # opsd's mean total (100, 120) is the smaller
    assert equal["grpo"]["steps"] == [5, 5] and equal["opsd"]["steps"] == [10, 5]
    assert equal["opsd_minus_grpo_points"] == pytest.approx(100 * ((0.4 + 0.2) / 2 - (0.15 + 0.1) / 2))
    by_step = learning.opsd_vs_grpo_equal_steps(runs)
    assert [p["step"] for p in by_step] == [0, 5, 10]
    assert by_step[2]["opsd_minus_grpo_points"] == pytest.approx(100 * ((0.4 + 0.3) / 2 - (0.2 + 0.1) / 2))
    assert by_step[2]["grpo"]["completion_tokens"] == 200 and by_step[2]["opsd"]["completion_tokens"] == 110
    assert learning.opsd_vs_grpo_equal_steps({"opsd": runs["opsd"]}) is None
    acceptance = learning.skill_acceptance(runs)
    assert acceptance["opsd_gain_points"] == 25.0 and acceptance["opsd_mean_gains_15_points"] is True
    assert acceptance["noise_moves_under_5_points"] is True and acceptance["base_accuracy_between_5_and_40"] is True
    task = {"title": "t", "eval_items": 100, "runs": runs, "target_accuracy": 0.2}
    learning.plot_skill(task, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_skill_runs_run_two_at_once_one_thread_each_and_report_in_the_order_asked(learning, tmp_path, monkeypatch):
    """`--skill-jobs 2`: two children at a time, each told to use one of the two cores; every run and
    seed reported, in `--skill-runs` order whatever order they finished in; the data written first."""
    import argparse
    import json
    import threading
    import time

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a built model: the task builds none
    running, most, lock = set(), [0], threading.Lock()
    asked_threads = []

    def fake_child(args, log, threads=None):
        out = next(Path(a.split("=", 1)[1]) for a in args if a.startswith("logging.output_dir="))
        assert (tmp_path / "digits" / "train.parquet").exists()
        with lock:
            running.add(out)
            most[0] = max(most[0], len(running))
            asked_threads.append(threads)
        time.sleep(0.3 if "opsd" in out.parts else 0.05)  # grpo finishes before opsd
        out.mkdir(parents=True)
        gain = {"opsd": 0.2, "grpo": 0.1}[out.parts[-2]]
        rows = records({0: 0.1, 2: 0.1 + gain}, 10)
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        eval_records(out, 0, {"a": "one", "b": "one"})
        eval_records(out, 2, {"a": "two", "b": "one"})
        with lock:
            running.discard(out)
        return 1.0, 2.0

    monkeypatch.setattr(learning, "run_child", fake_child)
    monkeypatch.setattr(learning.os, "cpu_count", lambda: 2)
    args = argparse.Namespace(skill_runs=["opsd", "grpo"], skill_seeds=2, skill_steps=2, skill_jobs=2,
                              skill_overrides=[f"model.path={model}", f"data.datasets.0.path={tmp_path / 'digits'}",
                                               "data.datasets.0.synthetic.n_train=4", "data.datasets.0.synthetic.n_eval=2",
                                               "eval.num_samples=2"])
    monkeypatch.setattr(learning, "plot_skill", lambda task, path: None)
    (tmp_path / "skill").mkdir()
    task = learning.skill_task(args, tmp_path / "skill", lambda section: None)
    assert most[0] == 2 and asked_threads == [1, 1, 1, 1]
    assert task["jobs"] == {"at_once": 2, "threads_per_run": 1}
    assert list(task["runs"]) == ["opsd", "grpo"]
    assert [s["seed"] for s in task["runs"]["opsd"]["seeds"]] == [0, 1]
    assert task["runs"]["opsd"]["student_gain"]["mean"] == pytest.approx(0.2)
    assert task["runs"]["grpo"]["student_gain"]["mean"] == pytest.approx(0.1)
    assert task["runs"]["grpo"]["seeds"][1]["answers"]["changed"] == 1


def test_a_failed_skill_run_is_reported_at_once_and_no_other_starts(learning, tmp_path, monkeypatch):
    """With two at once, a run that fails ends the task without waiting for the one still going,
    and no queued run starts after it."""
    import argparse
    import threading
    import time

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    started, lock = [], threading.Lock()

    def fake_child(args, log, threads=None):
        out = next(Path(a.split("=", 1)[1]) for a in args if a.startswith("logging.output_dir="))
        with lock:
            started.append(out.relative_to(tmp_path / "skill").as_posix())
        if out.parts[-2:] == ("opsd", "seed0"):
            time.sleep(0.1)
            raise SystemExit("`python -m opsd.train ...` failed (2)")
        time.sleep(1.0)
        raise AssertionError("a run that outlived the failure is not read")

    monkeypatch.setattr(learning, "run_child", fake_child)
    monkeypatch.setattr(learning, "plot_skill", lambda task, path: None)
    args = argparse.Namespace(skill_runs=["opsd", "grpo"], skill_seeds=2, skill_steps=2, skill_jobs=2,
                              skill_overrides=[f"model.path={model}", f"data.datasets.0.path={tmp_path / 'digits'}",
                                               "data.datasets.0.synthetic.n_train=4", "data.datasets.0.synthetic.n_eval=2",
                                               "eval.num_samples=2"])
    (tmp_path / "skill").mkdir()
    begun = time.monotonic()
    with pytest.raises(SystemExit, match="failed"):
        learning.skill_task(args, tmp_path / "skill", lambda section: None)
    assert time.monotonic() - begun < 0.9  # not after the other run's 1 s
    time.sleep(1.3)  # the run still going ends; nothing starts after it
    assert sorted(started) == ["opsd/seed0", "opsd/seed1"]
