"""The run summary: what a run did and where it ended up, on the console and in `summary.json`.

Built at the end of every run from the run's `metrics.jsonl` (so a resumed run still shows where it
started) and this process's wall time. `run_summary` returns a plain dict; extend it there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from opsd.loss_kinds import DISTILL_METRICS
from opsd.trainer.checkpoint import latest_checkpoint
from opsd.trainer.console import THIRD_PARTY_LOG
from opsd.trainer.metrics import describe_skipped, off_policy_warning, skipped_rows

SUMMARY_FILE = "summary.json"
STAGES = ("rollout", "train", "weight_sync", "eval")
"""The stages every step record times as `time_{stage}_s` (train = scoring, backward and optimizer step)."""
FIRST_LAST_KEYS = ("loss", *DISTILL_METRICS, "eval/accuracy", "eval/teacher_accuracy", "eval/retention_accuracy",
                   "eval/retention_nll")


def read_records(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl`, oldest first; an unreadable last line (a crash) is left out."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _first_last(records: list[dict], key: str) -> dict | None:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if not points:
        return None
    (first_step, first), (last_step, last) = points[0], points[-1]
    return {"first": first, "first_step": first_step, "last": last, "last_step": last_step}


def run_summary(records: list[dict], *, output_dir: Path, wall_time_s: float, start_step: int = 0,
                stopped: dict | None = None, mismatch_threshold: float | None = None,
                see_also: str | None = None) -> dict:
    """Steps, wall time by stage, tokens per second (this process's steps, after `start_step`), the
    first and last value of the loss and evaluation metrics (whole run), the rows of the data skipped
    (whole run), the held-out accuracy at the first and last evaluation, warnings, and the run's
    files. `stopped`: how a stop signal ended it (`RunStopped.describe()`); `mismatch_threshold`: see
    `off_policy_warning`; `see_also`: `logging.see_also`, the summary's last line."""
    output_dir = Path(output_dir)
    mine = [r for r in records if r["step"] > start_step or start_step == 0]  # step 0: the baseline evaluation
    stage_time = {stage: sum(r.get(f"time_{stage}_s", 0.0) for r in mine) for stage in STAGES}
    stage_time["other"] = max(0.0, wall_time_s - sum(stage_time.values()))
    tokens = sum(r.get("completion_tokens", 0) for r in mine)
    files = {"output_dir": str(output_dir), "metrics": str(output_dir / "metrics.jsonl"),
             "summary": str(output_dir / SUMMARY_FILE)}
    latest = latest_checkpoint(output_dir)  # a complete one: a half-written save is not offered
    if latest is not None:
        files["last_checkpoint"] = str(latest.path)
    if (output_dir / THIRD_PARTY_LOG).is_file():
        files["run_log"] = str(output_dir / THIRD_PARTY_LOG)
    if (output_dir / "rollouts").is_dir():
        files["rollouts"] = str(output_dir / "rollouts")
    return {
        "steps": max((r["step"] for r in records), default=0),
        "start_step": start_step,
        "trained_steps": sum(1 for r in mine if "loss" in r),
        "skipped_steps": sum(1 for r in mine if r.get("skipped_step")),
        "wall_time_s": wall_time_s,
        "stage_time_s": stage_time,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall_time_s if wall_time_s > 0 else math.nan,
        "metrics": (metrics := {key: fl for key in FIRST_LAST_KEYS if (fl := _first_last(records, key)) is not None}),
        "showed": what_it_showed(metrics),
        "held_out_accuracy": held_out_accuracy(records),
        "skipped_rows": skipped_rows(records[-1]) if records else {},
        "warnings": [w for w in [off_policy_warning(records, mismatch_threshold)] if w],
        "stopped": stopped,
        "files": files,
        "see_also": see_also,
    }


def held_out_accuracy(records: list[dict]) -> dict | None:
    """The student's accuracy on the eval split at its first evaluation (step 0 in a fresh run) and
    its last, the points between, and the same for the teacher's prompt when it was evaluated; None
    without two evaluations."""
    student = _first_last(records, "eval/accuracy")
    if student is None or student["first_step"] == student["last_step"]:
        return None
    items = [r["eval/num_samples"] for r in records if "eval/num_samples" in r]
    out = {"items": items[-1] if items else None,
           "student": {**student, "gain_points": round(100 * (student["last"] - student["first"]), 2)}}
    if (teacher := _first_last(records, "eval/teacher_accuracy")) is not None:
        out["teacher_prompt"] = teacher
    return out


def describe_held_out(held_out: dict) -> str:
    """`held-out accuracy (64 questions, greedy): student 0.0% at step 0 -> 23.4% at step 8 (+23.4
    points); with the teacher's prompt 71.9% at step 0, 54.7% at step 8`."""
    s = held_out["student"]
    items = f"{held_out['items']} questions, greedy" if held_out.get("items") else "greedy"
    line = (f"held-out accuracy ({items}): student {s['first']:.1%} at step {s['first_step']} -> {s['last']:.1%} "
            f"at step {s['last_step']} ({s['gain_points']:+.1f} points)")
    if t := held_out.get("teacher_prompt"):
        line += f"; with the teacher's prompt {t['first']:.1%} at step {t['first_step']}, {t['last']:.1%} at step {t['last_step']}"
    return line


def what_it_showed(metrics: dict) -> str:
    """One line on what moved: the distillation term from the first to the last step, and each
    accuracy from the first evaluation to the last (an accuracy that stayed at 0 is said to, not
    hidden). A divergence (never negative) moves by a share of where it started; a term that can be
    negative (`tinker_loss`) by its difference, as a share of a value near or below 0 means nothing."""
    parts = []
    for key, can_be_negative in DISTILL_METRICS.items():
        fl = metrics.get(key)
        if not fl or fl["first_step"] == fl["last_step"]:
            continue
        steps = f"from step {fl['first_step']} to {fl['last_step']}"
        if can_be_negative:
            parts.append(f"{key} went {fl['first']:.3g} -> {fl['last']:.3g} ({fl['last'] - fl['first']:+.3g}) {steps}")
        elif fl["first"]:
            change = (fl["last"] - fl["first"]) / fl["first"]
            parts.append(f"the divergence ({key}) {'fell' if change < 0 else 'rose'} {abs(change):.0%} {steps}")
    for key, name in (("eval/accuracy", "student accuracy"), ("eval/teacher_accuracy", "teacher-prompt accuracy"),
                      ("eval/retention_accuracy", "retention (general questions)")):
        fl = metrics.get(key)
        if fl and fl["first_step"] != fl["last_step"]:
            delta = 100 * (fl["last"] - fl["first"])
            moved = "did not move" if delta == 0 else f"moved {delta:+.1f} points"
            parts.append(f"{name} {moved} ({fl['first']:.3g} -> {fl['last']:.3g})")
    fl = metrics.get("eval/retention_nll")
    if fl and fl["first_step"] != fl["last_step"]:
        delta = fl["last"] - fl["first"]
        moved = "did not move" if delta == 0 else f"{'rose' if delta > 0 else 'fell'} {abs(delta):.3g} nats/token"
        parts.append(f"retention NLL of the held-out text {moved} ({fl['first']:.4g} -> {fl['last']:.4g}; lower is better)")
    return "; ".join(parts) or "nothing to compare (fewer than two steps or evaluations)"


def format_summary(summary: dict) -> str:
    stages = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in summary["stage_time_s"].items())
    lines = [
        f"run summary: step {summary['steps']} ({summary['trained_steps']} trained, {summary['skipped_steps']} "
        f"skipped in this process) in {summary['wall_time_s']:.1f} s: {stages}",
        f"  {summary['completion_tokens']} completion tokens, {summary['tokens_per_s']:.1f} tokens/s",
    ]
    if stopped := summary.get("stopped"):  # the CLI's last line says the rest
        lines[0] = lines[0].replace("run summary:", f"run summary (stopped by {stopped['signal']}):", 1)
    if summary.get("skipped_rows"):
        lines.append(f"  bad rows skipped: {describe_skipped(summary['skipped_rows'])} (data/skipped_* in metrics.jsonl)")
    lines += [f"  {warning}" for warning in summary.get("warnings", [])]
    if summary.get("held_out_accuracy"):
        lines.append(f"  {describe_held_out(summary['held_out_accuracy'])}")
    if summary.get("showed"):
        lines.append(f"  showed: {summary['showed']}")
    for key, fl in summary["metrics"].items():
        lines.append(f"  {key}: {fl['first']:.4g} (step {fl['first_step']}) -> {fl['last']:.4g} (step {fl['last_step']})")
    lines += [f"  {name}: {path}" for name, path in summary["files"].items()]
    if summary.get("see_also"):
        lines.append(f"  see also: {summary['see_also']}")
    return "\n".join(lines)


def write_summary(output_dir: Path, summary: dict) -> Path:
    path = Path(output_dir) / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path
