"""Does the student learn, and what does it forget? Accuracy and retention of a real model before and
during self-distillation, beside controls and a supervised baseline, task by task.

Each task runs the recipe (`python -m opsd.train`, one child process per run, from fresh weights)
and writes its own section of the report and its own PNG. Tasks (`--tasks`):

    text_facts   configs/learn_facts_smollm2.yaml: SmolLM2-135M-Instruct, fictional facts that only
                 the teacher's prompt holds, evaluated greedily at step 0 and every `eval.every` steps
                 on held-out question phrasings (student's and teacher's prompt), with retention
                 probes (`eval.retention`: NLL of a held-out text, general questions). Runs (`--runs`):

        opsd            the recipe as configured, `--opsd-steps` long (its first `train.max_steps`
                        steps are those of a run that long: the schedule is constant)
        no_privileged   the teacher's prompt is the student's (prompts.privileged=[]): divergence 0
        noise           the fact replaced by an irrelevant true sentence (columns.privileged_text=irrelevant)
        sft             supervised baseline: cross-entropy on the fact sentences (loss.kind=sft)
        model_teacher   another model teaches: sft's final model (its checkpoint's model/) is the
                        teacher (teacher.mode=model) of a fresh SmolLM2, no privileged text in any
                        prompt (prompts.privileged=[]); runs after sft, or reuses its directory

    visual       configs/learn_picture_facts_smollm2_vlm.yaml: SmolLM2-135M with a vision tower taught
                 here (opsd.smollm2_vlm, built first and timed), facts whose value the teacher only
                 sees as a picture ending the fact's sentence. Runs (`--visual-runs`): opsd; noise
                 (prompts.noise=normal, Visual-OPSD's ablation); no_privileged; sft (cross-entropy on
                 the fact in words, columns.privileged_text=fact). Its acceptance: opsd +15 points,
                 the controls within 5, the teacher's prompt 30 points above the student's at step 0.

    skill        configs/learn_digits_smollm2_vlm.yaml: a skill from real data, judged on inputs never
                 trained on. The seeing SmolLM2 with its tower also taught printed digits
                 (model.build: smollm2-vlm-digits) reads the UCI handwritten digits (scikit-learn's copy);
                 the teacher is also shown the digit printed; evaluation on handwritten digits no run
                 trains on. Runs (`--skill-runs`): opsd and grpo (`--skill-seeds`, 3 by default: mean
                 and min-max), opsd_reward (opsd + the answer-checking GRPO term), sft (cross-entropy on
                 the answer), noise and no_privileged. Accuracy by optimizer step and by sampled
                 completion token; the tokens each run needed to reach a stated accuracy; opsd beside
                 grpo at equal tokens and at equal steps; per seed, how many held-out answers changed
                 (a control's accuracy can stay while its answers move). Its acceptance: the opsd mean +15 points,
                 the controls within 5. The runs write no checkpoint (`checkpoint.save_final=false`).
                 `--skill-jobs` runs at once (2 by default), the cores shared, one thread each on 2 cores.

    .venv/bin/python bench/learning.py [--tasks text_facts visual skill] [--runs opsd no_privileged noise sft model_teacher]
        [--visual-runs opsd noise no_privileged sft] [--visual-opsd-steps 20]
        [--opsd-steps 30] [--out runs/learn] [key=value ...]

The model is converted first (timed apart). Prints progress to stderr and, last, one JSON object to
stdout, also written to <out>/report.json:

    {"tasks": {"text_facts": {"runs": {name: {"eval": [...], "retention": {...}, ...}},
                              "acceptance": {...}, "opsd_vs_sft": {...}, "png": ..., ...}},
     "runs": <the text_facts runs, as before tasks>, "acceptance": {...}, "machine": {...}, ...}

A task is a function in TASKS that runs in its own directory <out>/<task> (runs, PNG, its section
as report.json) and returns its report section; its `acceptance` keys are gathered into the top-level one as `<task>.<key>`. `key=value` overrides apply to
every run of the text task (e.g. train.max_steps=2).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/learn_facts_smollm2.yaml"
CONTROLS = {
    "opsd": [],
    "no_privileged": ["prompts.privileged=[]"],
    "noise": ["data.datasets.0.columns.privileged_text=irrelevant"],
    # One copy of each reference instead of samples_per_prompt identical ones: the same per-token
    # mean loss and gradient, a quarter of the forward.
    "sft": ["loss={kind: sft, ce_weight: 1}", "rollout.samples_per_prompt=1"],
}
MODEL_TEACHER = "model_teacher"
"""The text task's run taught by another model: the `sft` run's final model, privileged text in no prompt."""


def model_teacher_overrides(out: Path, steps: int) -> list[str]:
    """The `model_teacher` run's overrides: the teacher is the model `sft` saved at `steps` in `out`."""
    teacher = out / "sft" / f"checkpoint-{steps}" / "model"
    if teacher.is_relative_to(ROOT):  # the runs start in ROOT; the report names no machine's paths
        teacher = teacher.relative_to(ROOT)
    return ["prompts.privileged=[]", f"teacher={{mode: model, path: {teacher}}}"]


VISUAL_CONFIG = "configs/learn_picture_facts_smollm2_vlm.yaml"
VISUAL_CONTROLS = {
    "opsd": [],
    # Visual-OPSD's ablation: the picture's model inputs replaced by fresh standard normal noise.
    "noise": ["prompts.noise=normal"],
    "no_privileged": ["prompts.privileged=[]"],
    # Cross-entropy on the fact in words ("Ann's car is red."), which the OPSD teacher never reads.
    "sft": ["loss={kind: sft, ce_weight: 1}", "rollout.samples_per_prompt=1", "data.datasets.0.columns.privileged_text=fact"],
}
STAGES = ("rollout", "train", "weight_sync")
TRAINING_STAGES = tuple(f"time_{stage}_s" for stage in STAGES)
COLOURS = {"opsd": "tab:blue", "no_privileged": "tab:gray", "noise": "tab:orange", "sft": "tab:green",
           MODEL_TEACHER: "tab:purple"}


def say(line: str) -> None:
    """A line on stderr in one write: print's text and newline are two, which runs started at once interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_child(args: list[str], log: Path, threads: int | None = None) -> tuple[float, float]:
    """Run `python args...` from the repository root, output to `log`, with `threads` CPU threads
    (None: the recipe's default, every core); (wall s, CPU s of the child and its descendants)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    start = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        # wait4, not RUSAGE_CHILDREN: children that run at once each get their own CPU time
        _, status, usage = os.wait4(child.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"`python {' '.join(args)}` failed ({code}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def reusable_records(run_dir: Path, max_steps: int) -> list[dict] | None:
    """The records up to `max_steps` of a run that got there (an evaluation at max_steps included)."""
    from opsd.trainer.summary import read_records

    records = [r for r in read_records(run_dir / "metrics.jsonl") if r["step"] <= max_steps]
    done = any(r["step"] == max_steps and "eval/accuracy" in r for r in records)
    return records if done and records[0]["step"] == 0 else None


def eval_points(records: list[dict]) -> list[dict]:
    """Each evaluation of a run, with `train_s`: the training stages' seconds (rollout, scoring and
    update, weight sync) of the steps up to it; evaluation and start-up are not in it."""
    points, train_s = [], 0.0
    for r in records:
        train_s += sum(r.get(key, 0.0) for key in TRAINING_STAGES)
        if "eval/accuracy" in r:
            points.append({
                "step": r["step"],
                "student_accuracy": r["eval/accuracy"],
                "teacher_accuracy": r.get("eval/teacher_accuracy"),
                "student_answered": r["eval/answered"],
                "teacher_answered": r.get("eval/teacher_answered"),
                "retention_accuracy": r.get("eval/retention_accuracy"),
                "retention_nll": r.get("eval/retention_nll"),
                "train_s": train_s,
                "seconds": r["time_eval_s"],
                "retention_seconds": r.get("time_retention_s"),
            })
    return points


def retention_moved(evals: list[dict]) -> dict:
    """Retention at step 0 and at the last evaluation, and the change (points; nats per token)."""
    first, last = evals[0], evals[-1]
    def at(e):
        return {"step": e["step"], "accuracy": e["retention_accuracy"], "nll": e["retention_nll"]}
    change = {}
    if first["retention_accuracy"] is not None:
        change["accuracy_points"] = round(100 * (last["retention_accuracy"] - first["retention_accuracy"]), 1)
    if first["retention_nll"] is not None:
        change["nll"] = last["retention_nll"] - first["retention_nll"]
    return {"step_0": at(first), "end": at(last), "change": change}


def summarise(records: list[dict], wall_s: float | None, cpu_s: float | None) -> dict:
    """One run's report from its metrics.jsonl records (wall time None: the sum of its stages)."""
    evals = eval_points(records)
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    from opsd.loss_kinds import DISTILL_METRICS  # the distillation term is logged under its loss kind's name

    distill = next((k for k in DISTILL_METRICS if steps and k in steps[0]), None)
    stage_s = {stage: sum(r.get(f"time_{stage}_s", 0.0) for r in steps) for stage in STAGES}
    stage_s["eval"] = sum(e["seconds"] for e in evals)
    if wall_s is None:
        wall_s = sum(stage_s.values())
    else:
        stage_s["startup_and_exit"] = wall_s - sum(stage_s.values())
    per_step = {stage: statistics.median(r.get(f"time_{stage}_s", 0.0) for r in steps) for stage in STAGES} if steps else {}
    return {
        "eval": evals,
        "student_gain": evals[-1]["student_accuracy"] - evals[0]["student_accuracy"] if evals else None,
        "retention": retention_moved(evals) if evals else None,
        "steps": len(steps),
        "completion_tokens": sum(r["completion_tokens"] for r in steps),
        "distill_first_last": [steps[0][distill], steps[-1][distill]] if distill else None,  # sft: none
        "ce_first_last": [steps[0]["ce"], steps[-1]["ce"]] if steps else None,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "stage_s": stage_s,
        "median_step_s": per_step,
    }


def eval_at(run: dict, step: int) -> dict | None:
    return next((e for e in run["eval"] if e["step"] == step), None)


def gain_points(run: dict, step: int) -> float | None:
    """Held-out accuracy gained from step 0 to `step`, in points (None: no evaluation there)."""
    at = eval_at(run, step)
    return None if at is None else round(100 * (at["student_accuracy"] - run["eval"][0]["student_accuracy"]), 1)


def point(e: dict | None) -> dict | None:
    """An evaluation as the comparison shows it."""
    if e is None:
        return None
    keys = ("step", "student_accuracy", "retention_accuracy", "retention_nll", "train_s")
    return {k: e[k] for k in keys}


def opsd_vs_sft(runs: dict, steps: int, within_points: float = 10.0) -> dict | None:
    """OPSD beside the supervised baseline's final evaluation: at its step count, at its training
    seconds, and at the first evaluation where OPSD comes within `within_points` of its accuracy."""
    if "opsd" not in runs or "sft" not in runs:
        return None
    opsd, sft = runs["opsd"]["eval"], runs["sft"]["eval"]
    sft_end = sft[-1]
    target = sft_end["student_accuracy"] - within_points / 100
    in_time = [e for e in opsd if e["train_s"] <= sft_end["train_s"]]
    after = [e for e in opsd if e["train_s"] > sft_end["train_s"]]
    reached = next((e for e in opsd if e["student_accuracy"] >= target - 1e-9), None)
    best = max(opsd, key=lambda e: e["student_accuracy"])
    out = {
        "sft_end": point(sft_end),
        "target_accuracy": target,
        "equal_steps": {"opsd": point(eval_at(runs["opsd"], sft_end["step"])), "sft": point(sft_end)},
        # Training seconds (rollout, update, weight sync; no evaluation, no start-up): opsd's last
        # evaluation within sft's training time, and its next one, bracket the point of equal time.
        "equal_training_time": {"opsd": point(in_time[-1] if in_time else None), "opsd_next": point(after[0] if after else None),
                                "sft": point(sft_end)},
        "equal_accuracy": {"opsd": point(reached), "sft": point(sft_end)},
        "opsd_within_points": reached is not None,
    }
    if reached is None:
        short = 100 * (target - best["student_accuracy"])
        out["note"] = (f"opsd did not come within {within_points:g} points of sft's {100 * sft_end['student_accuracy']:.1f}% "
                       f"in {opsd[-1]['step']} steps: best {100 * best['student_accuracy']:.1f}% at step {best['step']}, "
                       f"{short:.1f} points short of the {100 * target:.1f}% target")
        out["equal_accuracy"]["opsd_closest"] = point(best)
    return out


def text_facts_acceptance(runs: dict, steps: int, comparison: dict | None) -> dict:
    """The bar, in points (percent) at `steps` (every run's length but opsd's): OPSD +20 from step 0,
    the controls within 5; and OPSD within 10 of SFT's final accuracy at some evaluation."""
    out = {f"{name}_gain_points": g for name, run in runs.items() if (g := gain_points(run, steps)) is not None}
    if "opsd" in runs:
        out["opsd_gains_20_points"] = out.get("opsd_gain_points", -100) >= 20
        out["opsd_end_gain_points"] = gain_points(runs["opsd"], runs["opsd"]["eval"][-1]["step"])
    for control in ("no_privileged", "noise"):
        if f"{control}_gain_points" in out:
            out[f"{control}_moves_under_5_points"] = abs(out[f"{control}_gain_points"]) < 5
    if comparison is not None:
        out["opsd_within_10_points_of_sft"] = comparison["opsd_within_points"]
    if f"{MODEL_TEACHER}_gain_points" in out:
        out[f"{MODEL_TEACHER}_gains_20_points"] = out[f"{MODEL_TEACHER}_gain_points"] >= 20
    return out


def plot_task(task: dict, path: Path) -> None:
    """Held-out accuracy by step; beside it, when the task probes retention, the general questions
    right and the held-out text's NLL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if task["retention"]:
        fig, (acc, questions, nll) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    else:
        fig, acc = plt.subplots(figsize=(6.5, 4.2))
        questions = nll = None
    base = None
    for name, run in task["runs"].items():
        steps = [e["step"] for e in run["eval"]]
        colour = COLOURS.get(name)
        acc.plot(steps, [100 * e["student_accuracy"] for e in run["eval"]], "o-", color=colour, label=f"{name}: student")
        if name == "opsd" and run["eval"][0]["teacher_accuracy"] is not None:
            acc.plot(steps, [100 * e["teacher_accuracy"] for e in run["eval"]], "s--", color=colour, alpha=0.6,
                     label="opsd: teacher prompt")
        if questions is not None and run["eval"][0]["retention_accuracy"] is not None:
            questions.plot(steps, [100 * e["retention_accuracy"] for e in run["eval"]], "o-", color=colour, label=name)
        if nll is not None and run["eval"][0]["retention_nll"] is not None:
            nll.plot(steps, [e["retention_nll"] for e in run["eval"]], "o-", color=colour, label=name)
        if base is None:
            base = 100 * run["eval"][0]["student_accuracy"]
    if base is not None:
        acc.axhline(base, color="black", linewidth=0.8, linestyle=":", label="base model (step 0)")
    acc.set_ylabel("held-out accuracy, greedy (%)")
    acc.set_ylim(-2, 102)
    acc.set_title(task["title"], fontsize=9)
    if questions is not None:
        questions.set_ylabel("general questions right, greedy (%)")
        questions.set_ylim(-2, 102)
        questions.set_title(f"retention: {task['retention']['questions']} questions the base model knew", fontsize=9)
        nll.set_ylabel("NLL of a held-out text (nats/token, lower is better)")
        nll.set_title(f"retention: {task['retention']['text'] or 'no text probe'}", fontsize=9)
    for ax in (acc, questions, nll):
        if ax is not None:
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
    acc.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def text_facts_task(args, out: Path, progress) -> dict:
    """The fictional-facts task: every run of `args.runs` in `out`; `progress(section)` after each.
    `model_teacher` is taught by the model `sft` saved at its last step."""
    from opsd.config import load_config

    steps = load_config(ROOT / args.config, args.overrides).train.max_steps
    controls = {**CONTROLS, MODEL_TEACHER: model_teacher_overrides(out, steps)}
    if MODEL_TEACHER in args.runs and "sft" not in args.runs and not (out / "sft" / f"checkpoint-{steps}" / "model").is_dir():
        raise SystemExit(f"--runs {MODEL_TEACHER} needs the sft run's model at {out / 'sft'}: add sft to --runs")
    return run_task(args, out, progress, title="SmolLM2-135M-Instruct learns fictional facts only its teacher's prompt holds",
                    config=args.config, controls=controls, run_names=args.runs, overrides=args.overrides,
                    opsd_steps=args.opsd_steps, acceptance=text_facts_acceptance)


def visual_acceptance(runs: dict, steps: int, comparison: dict | None) -> dict:
    """The bar of the visual task, in points from step 0 to each run's last evaluation: OPSD +15, the
    controls within 5, and the teacher's prompt (with the picture) 30 above the student's at step 0.
    `opsd_gain_points_at_<steps>`: opsd at the controls' length."""
    out = {f"{name}_gain_points": g for name, run in runs.items() if (g := gain_points(run, run["eval"][-1]["step"])) is not None}
    if "opsd" in runs:
        out[f"opsd_gain_points_at_{steps}"] = gain_points(runs["opsd"], steps)
        out["opsd_gains_15_points"] = out["opsd_gain_points"] >= 15
        start = runs["opsd"]["eval"][0]
        out["teacher_gap_step_0_points"] = round(100 * (start["teacher_accuracy"] - start["student_accuracy"]), 1)
        out["teacher_30_points_above_student_at_step_0"] = out["teacher_gap_step_0_points"] >= 30
    for control in ("no_privileged", "noise"):
        if f"{control}_gain_points" in out:
            out[f"{control}_moves_under_5_points"] = abs(out[f"{control}_gain_points"]) <= 5
    return out


def visual_task(args, out: Path, progress) -> dict:
    """Picture facts on the seeing SmolLM2: its model built first (timed), then every run of
    `args.visual_runs` in `out`."""
    from opsd.config import load_config

    model = load_config(ROOT / VISUAL_CONFIG, args.visual_overrides).model
    model_dir = Path(model.path)
    build = {"wall_s": 0.0, "cpu_s": 0.0, "skipped": (ROOT / model_dir / "config.json").exists() or model.build != "smollm2-vlm"}
    if not build["skipped"]:
        say(f"building the seeing SmolLM2 into {model_dir} ...")
        build["wall_s"], build["cpu_s"] = run_child(["-m", "opsd.smollm2_vlm", "--out", str(model_dir)], out / "build.log")
    task = run_task(args, out, progress, title="SmolLM2-135M with a taught vision tower learns facts its teacher only sees as pictures",
                    config=VISUAL_CONFIG, controls=VISUAL_CONTROLS, run_names=args.visual_runs, overrides=args.visual_overrides, opsd_steps=args.visual_opsd_steps,
                    acceptance=visual_acceptance, extra={"vlm_build": build}, minutes=25,
                    setup_s=(build["wall_s"], build["cpu_s"]))
    return task


def run_task(args, out: Path, progress, *, title: str, config: str, controls: dict, run_names: list[str],
             overrides: list[str], opsd_steps: int | None, acceptance, extra: dict | None = None, minutes: int = 20,
             setup_s: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Every run of `run_names` (names of `controls`) of the recipe `config` in `out`; `progress(section)`
    after each; the section's `acceptance` from `acceptance(runs, steps, opsd_vs_sft)` and whether the
    task, with its setup's (wall, CPU) seconds `setup_s`, took under `minutes`."""
    from opsd.config import load_config
    from opsd.trainer.summary import read_records

    cfg = load_config(ROOT / config, overrides)
    steps = cfg.train.max_steps
    opsd_steps = max(opsd_steps or steps, steps)
    dataset, retention = cfg.data.datasets[0], cfg.eval.retention
    task = {
        "title": title,
        "config": config,
        **(extra or {}),
        "facts": dataset.synthetic.n_facts if dataset.synthetic else None,
        "eval_items": cfg.eval.num_samples,
        "eval": "greedy, held-out question phrasings, answer = last task value named",
        "retention": {"text": retention.text, "text_tokens": retention.text_tokens, "questions": retention.questions,
                      "system": retention.system} if retention else {},
        "steps": steps,
        "opsd_steps": opsd_steps,
        "sequences_per_step": cfg.prompts_per_step * cfg.rollout.samples_per_prompt,
        "runs": {},
        "png": str(out / "learning_curve.png"),
    }
    started = time.perf_counter()
    section_file = out / "report.json"
    earlier = json.loads(section_file.read_text()).get("runs", {}) if args.keep and section_file.exists() else {}

    def write() -> None:
        runs = task["runs"]
        task["opsd_vs_sft"] = opsd_vs_sft(runs, steps)
        task["acceptance"] = acceptance(runs, steps, task["opsd_vs_sft"])
        # A reused run counts with its measured time (or, from records alone, its stages' time).
        task["wall_s"] = setup_s[0] + time.perf_counter() - started + sum(r["wall_s"] for r in runs.values() if r.get("reused"))
        task["cpu_s"] = setup_s[1] + sum(r["cpu_s"] or 0.0 for r in runs.values())
        task["acceptance"][f"under_{minutes}_minutes"] = task["wall_s"] < 60 * minutes
        section_file.write_text(json.dumps(task, indent=1))
        plot_task(task, out / "learning_curve.png")
        progress(task)

    for name in run_names:
        run_dir = out / name
        run_steps = opsd_steps if name == "opsd" else steps
        kept = reusable_records(run_dir, run_steps) if args.keep else None
        if kept:
            measured = earlier.get(name, {})
            if measured.get("steps") == run_steps and measured.get("wall_s"):  # its wall and CPU time as measured
                task["runs"][name] = {**measured, "reused": True}
            else:
                task["runs"][name] = {"overrides": controls[name], "reused": True, **summarise(kept, None, None)}
            say(f"  {name}: reused {run_dir} up to step {run_steps}")
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run every time (the recipe would resume a finished one)
        run_overrides = [*overrides, *controls[name], f"train.max_steps={run_steps}", f"logging.output_dir={run_dir}",
                     "logging.progress_bar=false"]
        say(f"run {name}: python -m opsd.train --config {config} {' '.join(run_overrides)}")
        wall, cpu = run_child(["-m", "opsd.train", "--config", config, *run_overrides], out / f"{name}.log")
        task["runs"][name] = {"overrides": controls[name], **summarise(read_records(run_dir / "metrics.jsonl"), wall, cpu)}
        evals = ", ".join(f"{e['step']}: {e['student_accuracy']:.2f}/{e['teacher_accuracy']}" for e in task["runs"][name]["eval"])
        moved = task["runs"][name]["retention"]["change"]
        say(f"  {name}: student/teacher accuracy by step {evals}; retention moved {moved} ({wall:.0f} s, {cpu:.0f} CPU s)")
        write()  # what is done so far is kept
    write()
    return task


SKILL_CONFIG = "configs/learn_digits_smollm2_vlm.yaml"
SKILL_CONTROLS = {
    "opsd": [],
    # The same prompts, samples and completion budget, the answer checked (the config's reward
    # section: answer_match), no teacher. Runs without a teacher skip the teacher prompt's
    # evaluation (half of every evaluation): it tells nothing about them, and the student's answers
    # are the same without it.
    "grpo": ["loss={kind: grpo}", "eval.with_teacher_prompt=false"],
    # OPSD with a verifier: the jsd term plus the GRPO term on the same samples.
    "opsd_reward": ["loss.reward_weight=1.0"],
    # Cross-entropy on the answer ("7 is seven."), one copy per prompt.
    "sft": ["loss={kind: sft, ce_weight: 1}", "rollout.samples_per_prompt=1", "prompts.privileged=[text]",
            "eval.with_teacher_prompt=false"],
    "noise": ["prompts.noise=normal"],
    "no_privileged": ["prompts.privileged=[]"],
}
SKILL_SEEDED = ("opsd", "grpo")
SKILL_TARGET_POINTS = 10
"""The stated accuracy of the tokens-to-reach comparison: opsd's mean step-0 accuracy + this many points."""
SKILL_COLOURS = {**COLOURS, "grpo": "tab:red", "opsd_reward": "tab:purple"}


def skill_points(records: list[dict]) -> list[dict]:
    """`eval_points` with `completion_tokens`: the completion tokens trained on up to each evaluation
    (sampled ones, except under sft, which samples none and trains on its reference texts)."""
    tokens, at = 0, {}
    for r in records:
        if r["step"] > 0 and "loss" in r:
            tokens += r["completion_tokens"]
        if "eval/accuracy" in r:
            at[r["step"]] = tokens
    return [{**e, "completion_tokens": at[e["step"]]} for e in eval_points(records)]


def answers_moved(run_dir: Path, first_step: int, last_step: int) -> dict:
    """How the student's held-out answers moved between two evaluations, from their records
    (opsd/evaluation.py): the items whose answer (normalised; "(none)": no answer found) changed, and
    the answers given at each, most common first. An accuracy that stays put can hide answers that
    moved: a control's right answers lost and others gained by chance."""
    from opsd.answers import normalise_answer
    from opsd.evaluation import ROLES, eval_file

    def answers(step: int) -> dict:
        rows = map(json.loads, eval_file(run_dir, step).read_text().splitlines())
        return {r["id"]: "(none)" if r["answer"] is None else normalise_answer(r["answer"])
                for r in rows if r["role"] == ROLES[""]}

    first, last = answers(first_step), answers(last_step)
    return {"changed": sum(first[item] != last.get(item) for item in first), "items": len(first),
            "first": {"step": first_step, "counts": dict(collections.Counter(first.values()).most_common())},
            "last": {"step": last_step, "counts": dict(collections.Counter(last.values()).most_common())}}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def skill_run_summary(seeds: list[dict]) -> dict:
    """A run's seeds and, per evaluation step, the mean and min-max of the held-out accuracy."""
    steps = [e["step"] for e in seeds[0]["eval"]]
    curve = []
    for i, step in enumerate(steps):
        points = [s["eval"][i] for s in seeds if i < len(s["eval"])]
        curve.append({"step": step, "completion_tokens": statistics.fmean(p["completion_tokens"] for p in points),
                      "student_accuracy": spread([p["student_accuracy"] for p in points]),
                      "teacher_accuracy": spread([p["teacher_accuracy"] for p in points]) if points[0]["teacher_accuracy"] is not None else None})
    return {"seeds": seeds, "student_gain": spread([s["student_gain"] for s in seeds]), "curve": curve,
            "wall_s": sum(s["wall_s"] for s in seeds), "cpu_s": sum(s["cpu_s"] or 0.0 for s in seeds)}


def tokens_to_reach(runs: dict, target: float) -> dict:
    """Per run and seed: the completion tokens (and steps) up to the first evaluation at `target`
    accuracy or above, or how far it got."""
    out = {}
    for name, run in runs.items():
        per_seed = []
        for s in run["seeds"]:
            hit = next((e for e in s["eval"] if e["student_accuracy"] >= target - 1e-9), None)
            best = max(s["eval"], key=lambda e: e["student_accuracy"])
            per_seed.append({"seed": s["seed"], "reached": hit is not None,
                             "completion_tokens": hit["completion_tokens"] if hit else None, "step": hit["step"] if hit else None,
                             "best_accuracy": best["student_accuracy"], "best_step": best["step"]})
        out[name] = per_seed
    return out


def at_tokens(seed: dict, tokens: float) -> dict:
    """The seed's last evaluation with at most `tokens` completion tokens trained on."""
    return [e for e in seed["eval"] if e["completion_tokens"] <= tokens + 1e-9][-1]


def opsd_vs_grpo(runs: dict) -> dict | None:
    """opsd and grpo at equal sampled completion tokens: the fewer of the two runs' totals (seed
    means), each run's last evaluation within it (its accuracy: mean and min-max over seeds)."""
    if "opsd" not in runs or "grpo" not in runs:
        return None
    tokens = min(statistics.fmean(s["eval"][-1]["completion_tokens"] for s in runs[name]["seeds"]) for name in ("opsd", "grpo"))
    out = {"completion_tokens": tokens}
    for name in ("opsd", "grpo"):
        points = [at_tokens(s, tokens) for s in runs[name]["seeds"]]
        out[name] = {"steps": [p["step"] for p in points], "student_accuracy": spread([p["student_accuracy"] for p in points]),
                     "gain_points": spread([100 * (p["student_accuracy"] - s["eval"][0]["student_accuracy"])
                                            for p, s in zip(points, runs[name]["seeds"])])}
    out["opsd_minus_grpo_points"] = 100 * (out["opsd"]["student_accuracy"]["mean"] - out["grpo"]["student_accuracy"]["mean"])
    return out


def opsd_vs_grpo_equal_steps(runs: dict) -> dict | None:
    """opsd and grpo at each evaluation step both have: held-out accuracy (mean and min-max over
    seeds) and the completion tokens sampled so far (seed mean). With evaluations a few steps apart
    the equal-token comparison can fall on an earlier evaluation of one run; this one cannot."""
    if "opsd" not in runs or "grpo" not in runs:
        return None
    curves = {name: {c["step"]: c for c in runs[name]["curve"]} for name in ("opsd", "grpo")}
    out = []
    for step in sorted(set(curves["opsd"]) & set(curves["grpo"])):
        point = {"step": step}
        for name in ("opsd", "grpo"):
            point[name] = {"student_accuracy": curves[name][step]["student_accuracy"],
                           "completion_tokens": curves[name][step]["completion_tokens"]}
        point["opsd_minus_grpo_points"] = 100 * (point["opsd"]["student_accuracy"]["mean"] - point["grpo"]["student_accuracy"]["mean"])
        out.append(point)
    return out


def skill_acceptance(runs: dict) -> dict:
    """The bar, in points from step 0 to each run's end: the opsd seeds' mean +15, the noise and
    no-privileged controls within 5; the base model's accuracy between 5% and 40% (a GRPO signal)."""
    out = {f"{name}_gain_points": round(100 * run["student_gain"]["mean"], 1) for name, run in runs.items()}
    if "opsd" in runs:
        out["opsd_mean_gains_15_points"] = out["opsd_gain_points"] >= 15
        base = runs["opsd"]["curve"][0]["student_accuracy"]["mean"]
        out["base_accuracy_points"] = round(100 * base, 1)
        out["base_accuracy_between_5_and_40"] = 0.05 <= base <= 0.40
    for control in ("no_privileged", "noise"):
        if f"{control}_gain_points" in out:
            out[f"{control}_moves_under_5_points"] = abs(out[f"{control}_gain_points"]) <= 5
    return out


def plot_skill(task: dict, path: Path) -> None:
    """Held-out accuracy by optimizer step and by completion tokens trained on: seed means, min-max bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    for name, run in task["runs"].items():
        colour = SKILL_COLOURS.get(name)
        for ax, x_key in zip(axes, ("step", "completion_tokens")):
            xs = [c[x_key] for c in run["curve"]]
            acc = [c["student_accuracy"] for c in run["curve"]]
            label = f"{name} ({len(run['seeds'])} seeds)" if len(run["seeds"]) > 1 else name
            ax.plot(xs, [100 * a["mean"] for a in acc], "o-", color=colour, label=label)
            if len(run["seeds"]) > 1:
                ax.fill_between(xs, [100 * a["min"] for a in acc], [100 * a["max"] for a in acc], color=colour, alpha=0.15)
            if name == "opsd" and run["curve"][0]["teacher_accuracy"] is not None:
                ax.plot(xs, [100 * c["teacher_accuracy"]["mean"] for c in run["curve"]], "s--", color=colour, alpha=0.5,
                        label="opsd: teacher prompt")
    target = task.get("target_accuracy")
    for ax, xlabel in zip(axes, ("optimizer step", "completion tokens trained on (sampled; sft: reference tokens)")):
        if target is not None:
            ax.axhline(100 * target, color="black", linewidth=0.8, linestyle=":", label=f"stated accuracy {100 * target:.0f}%")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out handwritten digits right, greedy (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0].set_title(task["title"], fontsize=9)
    axes[1].set_title(f"{task['eval_items']} held-out images; bands: min-max over seeds", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def skill_task(args, out: Path, progress) -> dict:
    """Handwritten digits on the seeing SmolLM2 taught printed ones: its model built first (timed),
    then every run of `args.skill_runs` in `out` (opsd and grpo once per seed of `args.skill_seeds`)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from opsd.config import load_config
    from opsd.data.dataset import prepare
    from opsd.trainer.summary import read_records

    overrides = list(args.skill_overrides) + ([f"train.max_steps={args.skill_steps}"] if args.skill_steps else [])
    cfg = load_config(ROOT / SKILL_CONFIG, overrides)
    model_dir = Path(cfg.model.path)
    build = {"wall_s": 0.0, "cpu_s": 0.0, "skipped": (ROOT / model_dir / "config.json").exists()}
    if not build["skipped"]:
        say(f"building the seeing SmolLM2 that reads printed digits into {model_dir} ...")
        build["wall_s"], build["cpu_s"] = run_child(["-m", "opsd.smollm2_vlm", "--digits", "--out", str(model_dir)],
                                                    out / "build.log")
    dataset = cfg.data.datasets[0].synthetic
    task = {
        "title": "SmolLM2-135M with a tower taught printed digits learns to read handwritten ones (UCI digits)",
        "config": SKILL_CONFIG, "overrides": overrides, "vlm_build": build,
        "data": f"UCI handwritten digits (scikit-learn's copy): {dataset.n_train} training images, {dataset.n_eval} held-out",
        "eval_items": cfg.eval.num_samples,
        "eval": "greedy, handwritten digits never trained on, answer = the last digit word named",
        "steps": cfg.train.max_steps,
        "sequences_per_step": cfg.prompts_per_step * cfg.rollout.samples_per_prompt,
        "seeds": list(range(args.skill_seeds)),
        "runs": {},
        "png": str(out / "learning_curve.png"),
    }
    started = time.perf_counter()

    def write() -> None:
        runs = task["runs"]
        if "opsd" in runs:
            task["target_accuracy"] = runs["opsd"]["curve"][0]["student_accuracy"]["mean"] + SKILL_TARGET_POINTS / 100
            task["tokens_to_target"] = tokens_to_reach(runs, task["target_accuracy"])
        task["opsd_vs_grpo_equal_tokens"] = opsd_vs_grpo(runs)
        task["opsd_vs_grpo_equal_steps"] = opsd_vs_grpo_equal_steps(runs)
        task["acceptance"] = skill_acceptance(runs)
        task["wall_s"] = build["wall_s"] + time.perf_counter() - started
        task["cpu_s"] = build["cpu_s"] + sum(r["cpu_s"] for r in runs.values())
        task["acceptance"]["under_40_minutes"] = task["wall_s"] < 40 * 60
        (out / "report.json").write_text(json.dumps(task, indent=1))
        plot_skill(task, out / "learning_curve.png")
        progress(task)

    def seeds_of(name: str) -> list[int]:
        return task["seeds"] if name in SKILL_SEEDED else task["seeds"][:1]

    failed = threading.Event()

    def run_seed(name: str, seed: int) -> dict | None:
        if failed.is_set():  # a worker free after a failed run takes no other
            return None
        try:
            return run_one_seed(name, seed)
        except BaseException:
            failed.set()
            raise

    def run_one_seed(name: str, seed: int) -> dict:
        run_dir = out / name / f"seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run every time (the recipe would resume a finished one)
        # checkpoint.save_final=false: the report needs only the records (a checkpoint is ~1 GB)
        run_overrides = [*overrides, *SKILL_CONTROLS[name], f"train.seed={seed}", f"logging.output_dir={run_dir}",
                         "logging.progress_bar=false", "checkpoint.save_final=false"]
        say(f"run {name} seed {seed}: python -m opsd.train --config {SKILL_CONFIG} {' '.join(run_overrides)}")
        wall, cpu = run_child(["-m", "opsd.train", "--config", SKILL_CONFIG, *run_overrides], out / f"{name}_seed{seed}.log",
                              threads=task["jobs"]["threads_per_run"] if args.skill_jobs > 1 else None)
        records = read_records(run_dir / "metrics.jsonl")
        evals = skill_points(records)
        return {"seed": seed, "overrides": SKILL_CONTROLS[name], "student_gain": evals[-1]["student_accuracy"] - evals[0]["student_accuracy"],
                "eval": evals, "answers": answers_moved(run_dir, evals[0]["step"], evals[-1]["step"]),
                "completion_tokens": evals[-1]["completion_tokens"], "wall_s": wall, "cpu_s": cpu,
                "reward_mean_first_last": [next((r.get("reward/mean") for r in records if "reward/mean" in r), None),
                                           next((r.get("reward/mean") for r in reversed(records) if "reward/mean" in r), None)]}

    # Runs at once share the cores: one thread each on 2 cores (measured: docs/learning.md).
    task["jobs"] = {"at_once": args.skill_jobs, "threads_per_run": max(1, (os.cpu_count() or 1) // args.skill_jobs)}
    # here, not by the first run: no run may read a split another is writing; its path, as the runs' (cwd ROOT) see it
    dataset_config = cfg.data.datasets[0]
    prepare(dataclasses.replace(dataset_config, path=str(ROOT / dataset_config.path)))
    done: dict[tuple[str, int], dict] = {}
    pool = ThreadPoolExecutor(args.skill_jobs)
    try:
        futures = {pool.submit(run_seed, name, seed): (name, seed) for name in args.skill_runs for seed in seeds_of(name)}
        for future in as_completed(futures):
            name, seed = futures[future]
            if (result := future.result()) is None:  # not run: another failed (its error comes next)
                continue
            done[name, seed] = result
            accs = ", ".join(f"{e['step']}: {e['student_accuracy']:.2f}" for e in result["eval"])
            moved = result["answers"]
            say(f"  {name} seed {seed}: held-out accuracy by step {accs}; answers changed on {moved['changed']} of "
                f"{moved['items']} ({result['wall_s']:.0f} s)")
            task["runs"] = {run: skill_run_summary([done[run, s] for s in seeds_of(run) if (run, s) in done])
                            for run in args.skill_runs if any((run, s) in done for s in seeds_of(run))}
            write()
    finally:
        # after a failed run start no other, and say so now: the run still going ends at exit
        pool.shutdown(wait=False, cancel_futures=True)
    write()
    return task


TASKS = {"text_facts": text_facts_task, "visual": visual_task, "skill": skill_task}
"""Task name -> function(args, its own directory, progress) -> the task's report section, holding
`acceptance`, `png`, `wall_s` and `cpu_s`; it calls `progress(section so far)` as its runs finish."""


def profile_speed(args, out: Path) -> dict:
    """bench/step_profile.py with `--profile-steps` steps: the report's `speed` key."""
    say(f"profiling {args.profile_steps} steps (bench/step_profile.py) ...")
    profile = out / "step_profile.json"
    with profile.open("w") as stdout, (out / "step_profile.log").open("w") as stderr:
        done = subprocess.run([sys.executable, "bench/step_profile.py", "--config", args.config, "--steps",
                               str(args.profile_steps), *args.overrides], cwd=ROOT, stdout=stdout, stderr=stderr)
    if done.returncode != 0:
        raise SystemExit(f"bench/step_profile.py failed; see {out / 'step_profile.log'}")
    return json.loads(profile.read_text().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--runs", nargs="+", choices=[*CONTROLS, MODEL_TEACHER], default=[*CONTROLS, MODEL_TEACHER],
                        help="text_facts: the runs (model_teacher after sft: sft's model teaches it)")
    parser.add_argument("--visual-runs", nargs="+", choices=list(VISUAL_CONTROLS), default=list(VISUAL_CONTROLS),
                        help="visual: the runs")
    parser.add_argument("--visual-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="visual: dotted.key=value overrides for every run of the visual task")
    parser.add_argument("--visual-opsd-steps", type=int, default=20,
                        help="visual: steps of the opsd run (the others run train.max_steps)")
    parser.add_argument("--skill-runs", nargs="+", choices=list(SKILL_CONTROLS), default=list(SKILL_CONTROLS),
                        help="skill: the runs")
    parser.add_argument("--skill-seeds", type=int, default=3, help="skill: seeds of the opsd and grpo runs (the others: 1)")
    parser.add_argument("--skill-jobs", type=int, default=2,
                        help="skill: runs at once, the cores shared between them (1: one at a time, on every core)")
    parser.add_argument("--skill-steps", type=int, default=0, help="skill: steps of every run (0 = the config's)")
    parser.add_argument("--skill-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="skill: dotted.key=value overrides for every run of the skill task")
    parser.add_argument("--opsd-steps", type=int, default=30,
                        help="text_facts: steps of the opsd run (the others run train.max_steps)")
    parser.add_argument("--config", default=CONFIG, help="text_facts: the recipe")
    parser.add_argument("--out", default="runs/learn", help="run directories, report.json and the PNGs go here")
    parser.add_argument("--keep", action="store_true",
                        help="reuse a run directory whose metrics.jsonl already reaches its steps (an interrupted "
                             "benchmark, or a longer run with a constant schedule): its records up to those steps "
                             "are reported with the wall and CPU time the task's report.json measured for that many "
                             "steps, else with the sum of its stages and no CPU time")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the tasks, bench/step_profile.py with this many steps (0 = skip): the 'speed' key")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every text_facts run")
    args = parser.parse_args(argv)
    if args.skill_jobs < 1:
        parser.error(f"--skill-jobs: at least 1, not {args.skill_jobs}")
    sys.path.insert(0, str(ROOT))
    from opsd.config import load_config

    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT / args.config, args.overrides)
    load_start = os.getloadavg()
    started = time.perf_counter()

    model_dir = Path(cfg.model.path)
    conversion = {"wall_s": 0.0, "cpu_s": 0.0, "skipped": (ROOT / model_dir / "config.json").exists() or (model_dir / "config.json").exists()}
    if cfg.model.build == "smollm2" and not conversion["skipped"]:
        say(f"converting SmolLM2 into {model_dir} ...")
        conversion["wall_s"], conversion["cpu_s"] = run_child(
            ["-m", "opsd.convert_smollm2", "--out", str(model_dir)], out / "convert.log"
        )

    report = {
        "command": " ".join(["python bench/learning.py", *(sys.argv[1:] if argv is None else argv)]),
        "tasks": {},
        "conversion": conversion,
    }

    def write() -> None:
        tasks = report["tasks"]
        report["runs"] = tasks.get("text_facts", {}).get("runs", {})  # where they were before tasks
        report["acceptance"] = {f"{name}.{key}": value for name, task in tasks.items()
                                for key, value in task.get("acceptance", {}).items()}
        # A reused run (--keep) counts with the time it took when it ran, as in its task's wall_s.
        reused_s = sum(run["wall_s"] for task in tasks.values() for run in task.get("runs", {}).values() if run.get("reused"))
        report["total_wall_s"] = time.perf_counter() - started + reused_s
        report["total_cpu_s"] = conversion["cpu_s"] + sum(task.get("cpu_s", 0.0) for task in tasks.values())
        # The 45 minutes of `make learn` from a fresh clone hold about 3 of .venv creation.
        report["acceptance"]["under_42_minutes"] = report["total_wall_s"] < 42 * 60
        report["machine"] = {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()}
        (out / "report.json").write_text(json.dumps(report, indent=1))

    for name in args.tasks:
        def progress(section: dict, name: str = name) -> None:
            report["tasks"][name] = section
            write()

        (out / name).mkdir(exist_ok=True)
        progress(TASKS[name](args, out / name, progress))
    if args.profile_steps:
        report["speed"] = profile_speed(args, out)
    write()
    pngs = ", ".join(task["png"] for task in report["tasks"].values())
    say(f"report: {out / 'report.json'}; curves: {pngs}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
