"""Does the student learn? Accuracy of a real model before and during self-distillation, with controls.

Runs the recipe (`python -m opsd.train`, one child process per run, from fresh weights) on
configs/learn_facts_smollm2.yaml: SmolLM2-135M-Instruct, fictional facts that only the teacher's
prompt holds, evaluated greedily at step 0 and every `eval.every` steps on held-out question
phrasings, with the student's prompt and with the teacher's. Runs (`--runs`, all in one report):

    opsd            the recipe as configured
    no_privileged   the teacher's prompt is the student's (prompts.privileged=[]): divergence 0
    noise           the fact replaced by an irrelevant true sentence (columns.privileged_text=irrelevant)
    sft             supervised baseline: cross-entropy on the fact sentences (loss.kind=sft), same steps

    .venv/bin/python bench/learning.py [--runs opsd no_privileged noise sft] [--out runs/learn] [key=value ...]

The model is converted first (timed apart). Prints progress to stderr and, last, one JSON object to
stdout: {"runs": {name: {"eval": [{"step", "student_accuracy", "teacher_accuracy", ...}], ...}},
"acceptance": {...}, ...}; writes it to <out>/report.json and the learning curve to
<out>/learning_curve.png. `key=value` overrides apply to every run (e.g. train.max_steps=2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
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
STAGES = ("rollout", "train", "weight_sync")


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(args: list[str], log: Path) -> tuple[float, float]:
    """Run `python args...` from the repository root, output to `log`; (wall s, CPU s)."""
    cpu, start = child_cpu_seconds(), time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"`python {' '.join(args)}` failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start, child_cpu_seconds() - cpu


def reusable_records(run_dir: Path, max_steps: int) -> list[dict] | None:
    """The records up to `max_steps` of a run that got there (an evaluation at max_steps included)."""
    from opsd.trainer.summary import read_records

    records = [r for r in read_records(run_dir / "metrics.jsonl") if r["step"] <= max_steps]
    done = any(r["step"] == max_steps and "eval/accuracy" in r for r in records)
    return records if done and records[0]["step"] == 0 else None


def summarise(records: list[dict], wall_s: float | None, cpu_s: float | None) -> dict:
    """One run's report from its metrics.jsonl records (wall time None: the sum of its stages)."""
    evals = [
        {
            "step": r["step"],
            "student_accuracy": r["eval/accuracy"],
            "teacher_accuracy": r.get("eval/teacher_accuracy"),
            "student_answered": r["eval/answered"],
            "teacher_answered": r.get("eval/teacher_answered"),
            "seconds": r["time_eval_s"],
        }
        for r in records if "eval/accuracy" in r
    ]
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
        "steps": len(steps),
        "completion_tokens": sum(r["completion_tokens"] for r in steps),
        "distill_first_last": [steps[0][distill], steps[-1][distill]] if distill else None,  # sft: none
        "ce_first_last": [steps[0]["ce"], steps[-1]["ce"]] if steps else None,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "stage_s": stage_s,
        "median_step_s": per_step,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.6, 4.2))
    colours = {"opsd": "tab:blue", "no_privileged": "tab:gray", "noise": "tab:orange", "sft": "tab:green"}
    base = None
    for name, run in report["runs"].items():
        steps = [e["step"] for e in run["eval"]]
        colour = colours.get(name, None)
        ax.plot(steps, [100 * e["student_accuracy"] for e in run["eval"]], "o-", color=colour, label=f"{name}: student")
        if name == "opsd" and run["eval"][0]["teacher_accuracy"] is not None:
            ax.plot(steps, [100 * e["teacher_accuracy"] for e in run["eval"]], "s--", color=colour, alpha=0.6,
                    label="opsd: teacher prompt")
        if base is None:
            base = 100 * run["eval"][0]["student_accuracy"]
    if base is not None:
        ax.axhline(base, color="black", linewidth=0.8, linestyle=":", label="base model (step 0)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(report["task"]["title"], fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the curves, not on them
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance(runs: dict) -> dict:
    """The issue's bar, in points (percent): OPSD +20 from step 0, the no-privileged control < 5."""
    gain = {name: round(100 * run["student_gain"], 1) for name, run in runs.items() if run["student_gain"] is not None}
    out = {f"{name}_gain_points": g for name, g in gain.items()}
    if "opsd" in gain:
        out["opsd_gains_20_points"] = gain["opsd"] >= 20
    if "no_privileged" in gain:
        out["no_privileged_moves_under_5_points"] = abs(gain["no_privileged"]) < 5
    return out


def write_report(cfg, args, runs: dict, conversion: dict, out: Path, started: float, load_start, speed=None) -> dict:
    """The report of the runs so far, written to <out>/report.json with its learning curve PNG."""
    report = {
        "task": {
            "title": "SmolLM2-135M-Instruct learns fictional facts only its teacher's prompt holds",
            "config": args.config,
            "facts": cfg.data.datasets[0].synthetic.n_facts if cfg.data.datasets[0].synthetic else None,
            "eval_items": cfg.eval.num_samples,
            "eval": "greedy, held-out question phrasings, answer = last task value named",
            "steps": cfg.train.max_steps,
            "sequences_per_step": cfg.prompts_per_step * cfg.rollout.samples_per_prompt,
        },
        "command": " ".join(["python bench/learning.py", "--runs", *args.runs, *args.overrides]),
        "runs": runs,
        "acceptance": acceptance(runs),
        "conversion": conversion,
        # A reused run counts with its stages' time (its startup is not known).
        "total_wall_s": time.perf_counter() - started + sum(r["wall_s"] for r in runs.values() if r.get("reused")),
        "total_cpu_s": conversion["cpu_s"] + sum(r["cpu_s"] or 0.0 for r in runs.values()),
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "speed": speed,
    }
    report["acceptance"]["under_30_minutes"] = report["total_wall_s"] < 1800
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "learning_curve.png")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=list(CONTROLS), default=list(CONTROLS))
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--out", default="runs/learn", help="run directories, report.json and the PNG go here")
    parser.add_argument("--keep", action="store_true",
                        help="reuse a run directory whose metrics.jsonl already reaches train.max_steps (an "
                             "interrupted benchmark, or a longer run with a constant schedule): its records up to "
                             "max_steps are reported, its wall time is the sum of its stages, its CPU time unknown")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="after the runs, bench/step_profile.py with this many steps (0 = skip): the 'speed' key")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from opsd.config import load_config
    from opsd.trainer.summary import read_records

    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT / args.config, args.overrides)
    load_start = os.getloadavg()
    started = time.perf_counter()

    model_dir = Path(cfg.model.path)
    conversion = {"wall_s": 0.0, "cpu_s": 0.0, "skipped": (ROOT / model_dir / "config.json").exists() or (model_dir / "config.json").exists()}
    if cfg.model.build == "smollm2" and not conversion["skipped"]:
        print(f"converting SmolLM2 into {model_dir} ...", file=sys.stderr, flush=True)
        conversion["wall_s"], conversion["cpu_s"] = run_child(
            ["-m", "opsd.convert_smollm2", "--out", str(model_dir)], out / "convert.log"
        )

    runs = {}
    for name in args.runs:
        run_dir = out / name
        kept = reusable_records(run_dir, cfg.train.max_steps) if args.keep else None
        if kept:
            runs[name] = {"overrides": CONTROLS[name], "reused": True, **summarise(kept, None, None)}
            print(f"  {name}: reused {run_dir} up to step {cfg.train.max_steps}", file=sys.stderr, flush=True)
            continue
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)  # a fresh run every time (the recipe would resume a finished one)
        overrides = [*args.overrides, *CONTROLS[name], f"logging.output_dir={run_dir}",
                     "logging.progress_bar=false"]
        print(f"run {name}: python -m opsd.train --config {args.config} {' '.join(overrides)}", file=sys.stderr, flush=True)
        wall, cpu = run_child(["-m", "opsd.train", "--config", args.config, *overrides], out / f"{name}.log")
        runs[name] = {"overrides": CONTROLS[name], **summarise(read_records(run_dir / "metrics.jsonl"), wall, cpu)}
        evals = ", ".join(f"{e['step']}: {e['student_accuracy']:.2f}/{e['teacher_accuracy']}" for e in runs[name]["eval"])
        print(f"  {name}: student/teacher accuracy by step {evals} ({wall:.0f} s)", file=sys.stderr, flush=True)
        write_report(cfg, args, runs, conversion, out, started, load_start)  # what is done so far is kept

    speed = None
    if args.profile_steps:
        print(f"profiling {args.profile_steps} steps (bench/step_profile.py) ...", file=sys.stderr, flush=True)
        profile = out / "step_profile.json"
        with profile.open("w") as stdout:
            done = subprocess.run([sys.executable, "bench/step_profile.py", "--config", args.config, "--steps",
                                   str(args.profile_steps), *args.overrides], cwd=ROOT, stdout=stdout,
                                  stderr=(out / "step_profile.log").open("w"))
        if done.returncode != 0:
            raise SystemExit(f"bench/step_profile.py failed; see {out / 'step_profile.log'}")
        speed = json.loads(profile.read_text().strip().splitlines()[-1])
    report = write_report(cfg, args, runs, conversion, out, started, load_start, speed)
    print(f"report: {out / 'report.json'}; learning curve: {out / 'learning_curve.png'}", file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
