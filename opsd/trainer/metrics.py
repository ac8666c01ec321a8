"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step), console lines, wandb."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

from opsd.config import LoggingConfig

CONSOLE_KEYS = ("loss", "jsd", "ce", "lr", "grad_norm", "completion_len", "logprob_mismatch_max")


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, output_dir: Path, run_config: dict):
        self.cfg = cfg
        self.path = output_dir / "metrics.jsonl"
        self.file = self.path.open("w")
        self.wandb_run = None
        if cfg.wandb.mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.name, mode=cfg.wandb.mode,
                config=run_config, dir=str(output_dir),
            )

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

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass
