"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step), console lines, wandb."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from opsd.config import Config, LoggingConfig
from opsd.loss_kinds import DISTILL_METRICS, build_loss

CONSOLE_KEYS = (
    "loss", *DISTILL_METRICS, "ce", "lr", "grad_norm", "completion_len", "logprob_mismatch_max", "eval/accuracy",
    "eval/teacher_accuracy",
)


MISMATCH_THRESHOLD = {"float32": 0.01, "bfloat16": 0.1}
"""`logprob_mismatch_mean` (nats per token) above which the engine's samples are not the student's,
by `model.dtype`. The engine and the trainer agree to ~1e-6 in float32 and to ~1e-2 in bfloat16 when
the engine holds the trainer's weights and sees its prompt; another prompt or stale weights give 0.1
to several nats."""
MISMATCH_PATIENCE = 3
"""Trained steps in a row above the threshold before the run is called off-policy."""


def mismatch_threshold(cfg: Config) -> float | None:
    """The run's `MISMATCH_THRESHOLD`; None when nothing is sampled (a loss kind that is not on-policy,
    `sft`) or the trainer's scores are noisy by design (LoRA dropout)."""
    if not build_loss(cfg.loss).on_policy or (cfg.model.lora is not None and cfg.model.lora.dropout > 0):
        return None
    return MISMATCH_THRESHOLD[cfg.model.dtype]


def off_policy_warning(records: list[dict], threshold: float | None) -> str | None:
    """A warning when the last `MISMATCH_PATIENCE` trained steps all sampled off-policy, else None."""
    trained = [r for r in records if isinstance(r.get("logprob_mismatch_mean"), (int, float))]
    last = trained[-MISMATCH_PATIENCE:]
    if threshold is None or len(last) < MISMATCH_PATIENCE or any(r["logprob_mismatch_mean"] <= threshold for r in last):
        return None
    return (f"WARNING: the engine's samples are not the student's: logprob_mismatch_mean stayed above {threshold:g} "
            f"for {len(last)} steps (steps {last[0]['step']}-{last[-1]['step']}, last {last[-1]['logprob_mismatch_mean']:.3g}), "
            "so the run is off-policy. The engine samples from another prompt or other weights than the trainer "
            "scores (a custom engine's prompt, a weight sync that does not land); `--check` shows it (docs/faults.md)")


def skipped_rows(record: dict) -> dict[str, int]:
    """Rows of the data skipped so far, by reason (the record's `data/skipped_<reason>` counts)."""
    prefix = "data/skipped_"
    return {key[len(prefix):]: int(value) for key, value in sorted(record.items()) if key.startswith(prefix) and value}


def describe_skipped(skipped: dict[str, int]) -> str:
    return f"{sum(skipped.values())} ({', '.join(f'{reason} {n}' for reason, n in skipped.items())})"


class RecordWatch:
    """Console lines for what a step record shows that needs a person: rows skipped since the last
    line, samples that are not the student's (once)."""

    def __init__(self, mismatch_threshold: float | None = None):
        self.mismatch_threshold = mismatch_threshold
        self.records: list[dict] = []
        self.skipped_total = 0
        self.warned_off_policy = False

    def lines(self, record: dict, *, console_step: bool = True) -> list[str]:
        """`console_step`: the step's metrics line is shown (`logging.log_every`); the skipped rows come with it."""
        out = []
        skipped = skipped_rows(record)
        if console_step and sum(skipped.values()) > self.skipped_total:
            out.append(f"data: bad rows skipped so far: {describe_skipped(skipped)} "
                       "(data/skipped_* in metrics.jsonl; data.on_bad_sample=error stops at the first)")
            self.skipped_total = sum(skipped.values())
        if "logprob_mismatch_mean" in record:
            self.records = (self.records + [record])[-MISMATCH_PATIENCE:]
        warning = off_policy_warning(self.records, self.mismatch_threshold)
        if warning and not self.warned_off_policy:
            out.append(warning)
            self.warned_off_policy = True
        return out


class MetricsLogger:
    def __init__(
        self, cfg: LoggingConfig, output_dir: Path, run_config: dict, *,
        resume_step: int | None = None, wandb_run_id: str | None = None, mismatch_threshold: float | None = None,
    ):
        """`resume_step`: continue a resumed run's `metrics.jsonl` after that step (later records,
        written after the checkpoint, are dropped); `wandb_run_id`: continue that wandb run;
        `mismatch_threshold`: see `RecordWatch`."""
        self.cfg = cfg
        self.watch = RecordWatch(mismatch_threshold)
        self.path = output_dir / "metrics.jsonl"
        if resume_step is None:
            self.file = self.path.open("w")
        else:
            dropped = drop_records_after(self.path, resume_step)
            if dropped:
                tqdm.write(dropped)
            self.file = self.path.open("a")
        self.wandb_run = None
        if cfg.wandb.mode != "disabled":
            import wandb

            # wandb's own banners (version, sync hints, run summary) stay off the console unless
            # `verbose`: one line of ours says where the run goes, so the console is as short as without it.
            self.wandb_run = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.name, mode=cfg.wandb.mode,
                config=run_config, dir=str(output_dir),
                id=wandb_run_id, resume="allow" if wandb_run_id else None,
                settings=wandb.Settings(silent=not cfg.verbose),
            )
            where = (f"offline under {output_dir}/wandb (upload later: wandb sync {output_dir}/wandb/offline-run-*)"
                     if cfg.wandb.mode == "offline" else getattr(self.wandb_run, "url", None) or "online")
            tqdm.write(f"wandb: run {self.wandb_run.id}, {where}")

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        console_step = step % self.cfg.log_every == 0
        if console_step:
            tqdm.write(format_line(record))
        for line in self.watch.lines(record, console_step=console_step):
            tqdm.write(line)

    def close(self) -> None:
        """Idempotent: the error path and the end of a run may both call it."""
        if self.file.closed:
            return
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def drop_records_after(path: Path, step: int) -> str | None:
    """Before a resumed run appends: drop the records of steps after `step` (logged after the
    checkpoint it continues from, before the run stopped) and lines that are not records (a torn
    last line of a killed process); the file is replaced atomically, and only when there is
    something to drop, whose description is returned. Otherwise the file is left as it is."""
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    kept, later, torn = [], [], 0
    for line in lines:
        try:
            record = json.loads(line)
            later_step = record["step"] > step
        except (json.JSONDecodeError, KeyError, TypeError):
            torn += 1
            continue
        (later if later_step else kept).append((record["step"], line))
    if not later and not torn:
        return None
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for _, line in kept))
    os.replace(tmp, path)
    dropped = [f"{len(later)} record(s) of steps {later[0][0]}-{later[-1][0]}, logged after checkpoint-{step}"] if later else []
    dropped += [f"{torn} line(s) that are not JSON records (a write cut short)"] if torn else []
    return f"metrics: dropped {' and '.join(dropped)} from {path}; this run continues after step {step}"


def format_line(record: dict) -> str:
    parts = [f"step {record['step']}"]
    for key in CONSOLE_KEYS:
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{key} {value:.3g}" if math.isfinite(value) else f"{key} {value}")
        elif value is not None:
            parts.append(f"{key} {value}")
    return " | ".join(parts)


class NullMetricsLogger:
    """Stands in for `MetricsLogger` on the ranks other than rank 0, which log nothing."""

    wandb_run_id = None

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


class StageTimer:
    """Wall-clock seconds of a step's stages and of the parts inside them: `with timer("train"): ...`
    (repeats add up), `with timer.part("backward"): ...` inside a stage, then `timer.record()` ->
    `{"time_train_s": ..., "time_train/backward_s": ...}`.

    Parts are host time: on a GPU, work queued in one part may finish in a later one that waits for it.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}
        self._stage: str | None = None

    @contextmanager
    def __call__(self, stage: str):
        start, self._stage = time.perf_counter(), stage
        try:
            yield
        finally:
            self._stage = None
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    @contextmanager
    def part(self, name: str):
        """A part of the stage that is running (`StageTimer.part` is a `opsd.scoring.Timed`)."""
        stage, start = self._stage, time.perf_counter()
        try:
            yield
        finally:
            parts = self.parts.setdefault(stage, {})
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - start

    def record(self) -> dict[str, float]:
        record = {f"time_{stage}_s": seconds for stage, seconds in self.seconds.items()}
        for stage, parts in self.parts.items():
            record.update({f"time_{stage}/{name}_s": seconds for name, seconds in parts.items()})
        return record
