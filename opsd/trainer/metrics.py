"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step), console lines, wandb."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from opsd.config import LoggingConfig
from opsd.loss_kinds import DISTILL_METRICS

CONSOLE_KEYS = (
    "loss", *DISTILL_METRICS, "ce", "lr", "grad_norm", "completion_len", "logprob_mismatch_max", "eval/accuracy",
    "eval/teacher_accuracy",
)


class MetricsLogger:
    def __init__(
        self, cfg: LoggingConfig, output_dir: Path, run_config: dict, *,
        resume_step: int | None = None, wandb_run_id: str | None = None,
    ):
        """`resume_step`: continue a resumed run's `metrics.jsonl` after that step (later records,
        written after the checkpoint, are dropped); `wandb_run_id`: continue that wandb run."""
        self.cfg = cfg
        self.path = output_dir / "metrics.jsonl"
        if resume_step is None:
            self.file = self.path.open("w")
        else:
            drop_records_after(self.path, resume_step)
            self.file = self.path.open("a")
        self.wandb_run = None
        if cfg.wandb.mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.name, mode=cfg.wandb.mode,
                config=run_config, dir=str(output_dir),
                id=wandb_run_id, resume="allow" if wandb_run_id else None,
            )

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if step % self.cfg.log_every == 0:
            tqdm.write(format_line(record))

    def close(self) -> None:
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def drop_records_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` (replaced atomically); nothing to do if absent.

    A process killed while writing can leave a torn last line; it is dropped with the later records.
    """
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}, line {number}: not a JSON record") from None
        if record["step"] <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


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
