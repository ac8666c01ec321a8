"""A run's checkpoints: what to resume from at the start, when to save, which ones to keep.

Exact resume: a continued run restores the weights, optimizer, LR schedule, teacher, data position,
counters, best metric and every rank's RNG states, so steps N+1... are the ones an uninterrupted run
would have taken. The rollout engine needs no saved state: each step's sampling seed is a function
of (`train.seed`, step) (see `sampling_settings` in opsd/rollout/engine.py), and `train.seed` itself is
checked through the data stream's state. The engine does need the restored weights: it starts from
`model.path`, so the trainer pushes the student into it before the first rollout.

An output directory holds one run's history: a fresh start refuses a directory that already holds
checkpoints, and a resume refuses one that holds checkpoints newer than the one it resumes from
(unless `checkpoint.discard_newer` moves them aside). Faults and what they leave: docs/faults.md.
"""

from __future__ import annotations

import math
from pathlib import Path

from tqdm.auto import tqdm

from opsd.config import Config, config_to_dict
from opsd.device import process_rank
from opsd.trainer.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    TrainingParts,
    checkpoint_bytes,
    free_mb,
    incomplete_checkpoints,
    list_checkpoints,
    load_checkpoint,
    load_rng_state,
    move_aside,
    read_trainer_state,
    remove_leftovers,
    resolve_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from opsd.trainer.optim import apply_on_resume
from opsd.trainer.rng import set_rng_state

# Settings that may change between a run and its resumption without a note.
UNREMARKABLE_CHANGES = ("checkpoint.", "logging.progress_bar", "logging.log_every")


def _say(message: str) -> None:
    if process_rank() == 0:  # under torchrun every rank manages the same checkpoints: one voice
        tqdm.write(f"checkpoint: {message}")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_settings(saved: dict, current: dict) -> list[str]:
    """`key: old -> new` for every config value that differs, ignoring checkpoint and display keys."""
    old, new = _flatten(saved), _flatten(current)
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not key.startswith(UNREMARKABLE_CHANGES)
    ]


class CheckpointManager:
    """Created at the start of a run, before anything is built: cleans up after a crash and finds
    the checkpoint to resume from; `start` restores it; `step_end` saves and rotates."""

    def __init__(self, cfg: Config, output_dir: Path):
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.output_dir = Path(output_dir)
        for path in remove_leftovers(self.output_dir):
            _say(f"removed {path.name}, left behind by an interrupted save")
        # A checkpoint-N without its manifest is a save that did not finish: it would collide with
        # this run's save of step N. Kept (renamed), never deleted.
        for path, target in move_aside(incomplete_checkpoints(self.output_dir), "incomplete"):
            _say(f"moved {path.name} aside to {target.name}: it has no manifest (a save that did not finish)")
        self.source = self._find_source()
        if self.source is not None:
            self._verify_source()  # fail before the engine and models are built
        self.saved_state = read_trainer_state(self.source) if self.source else None
        self.continues = self.source is not None and not self.ckpt.resume_model_only
        self._check_history()
        self.best = self._restored_best()
        self.counters = dict(self.saved_state["counters"]) if self.continues else {"completion_tokens": 0, "skipped_steps": 0}
        self.parts: TrainingParts | None = None
        self.wandb_run_id: str | None = None
        self.last_saved_step: int | None = self.resume_step
        """The step of this run's newest checkpoint (the resumed one at the start)."""
        self._warned_missing_metric = False

    @property
    def resume_step(self) -> int | None:
        """The step a continued run picks up after; None for a fresh start or a weights-only resume."""
        return self.saved_state["step"] if self.continues else None

    @property
    def saved_wandb_run_id(self) -> str | None:
        return self.saved_state.get("wandb_run_id") if self.continues else None

    def _find_source(self) -> Path | None:
        where = self.ckpt.resume_from
        if where is None:
            return None
        if where == "auto":
            found = list_checkpoints(self.output_dir)
            if not found:
                _say(f"resume_from=auto: no checkpoint in {self.output_dir}, starting fresh")
                return None
            return found[-1].path
        return resolve_checkpoint(Path(where))

    def _verify_source(self) -> None:
        """The resume checkpoint is intact; when it is not, name the newest one beside it that is."""
        try:
            verify_checkpoint(self.source)
        except CheckpointError as err:
            intact = _newest_intact_before(self.source)
            if intact is None:
                raise
            raise CheckpointError(
                f"{err}. The newest intact checkpoint is {intact}: continue from it with "
                f"checkpoint.resume_from={intact} checkpoint.discard_newer=true (the newer ones are moved "
                "aside, not deleted)"
            ) from None

    def _check_history(self) -> None:
        existing = list_checkpoints(self.output_dir)
        names = ", ".join(c.path.name for c in existing)
        if self.continues:
            later = [c for c in existing if c.step > self.saved_state["step"]]
            if later and self.ckpt.discard_newer:
                for path, target in move_aside([c.path for c in later], "discarded"):
                    _say(f"moved {path.name} aside to {target.name} (checkpoint.discard_newer)")
            elif later:
                raise CheckpointError(
                    f"resuming from {self.source} (step {self.saved_state['step']}), but logging.output_dir "
                    f"{self.output_dir} also holds later checkpoints ({', '.join(c.path.name for c in later)}); "
                    "set checkpoint.discard_newer=true to move them aside, or resume into another logging.output_dir"
                )
        elif existing:
            hint = (
                "checkpoint.resume_model_only starts a new run: choose another logging.output_dir, or "
                "continue the run in it with checkpoint.resume_model_only=false and checkpoint.resume_from=auto"
                if self.ckpt.resume_model_only else
                "set checkpoint.resume_from=auto to continue that run, or choose another logging.output_dir"
            )
            raise CheckpointError(f"logging.output_dir {self.output_dir} already holds checkpoints ({names}): {hint}")

    def _restored_best(self) -> dict | None:
        best = self.saved_state.get("best") if self.continues else None
        if best and best["metric"] != self.ckpt.metric_for_best_model:
            _say(f"metric_for_best_model changed from {best['metric']!r}: the best checkpoint is chosen afresh")
            return None
        return best

    def start(self, parts: TrainingParts, wandb_run_id: str | None = None) -> int:
        """Restore `parts` from the resume checkpoint (if any); returns the last completed step."""
        self.parts, self.wandb_run_id = parts, wandb_run_id
        if self.source is None:
            return 0
        if not self.continues:
            load_checkpoint(self.source, parts, weights_only=True, from_ema=self.ckpt.resume_from_ema)
            parts.teacher.restart_from(parts.student)  # from the loaded weights, as at any fresh start
            _say(f"started from the {'EMA ' if self.ckpt.resume_from_ema else ''}weights of {self.source} (new run, step 0)")
            return 0
        changes = changed_settings(self.saved_state["config"], config_to_dict(self.cfg))
        if changes:
            _say("settings differ from the checkpoint's run; this run uses the new values:\n  " + "\n  ".join(changes))
        load_checkpoint(self.source, parts)
        apply_on_resume(self.cfg.optim, parts.optimizer, parts.scheduler)  # the saved state holds the old settings
        try:
            parts.stream.load_state_dict(self.saved_state["data_stream"])
        except ValueError as err:
            raise CheckpointError(f"checkpoint {self.source}: {err}") from None
        step = self.saved_state["step"]
        _say(f"resumed from {self.source} at step {step}")
        if step >= self.cfg.train.max_steps:
            _say(f"step {step} >= train.max_steps {self.cfg.train.max_steps}: nothing left to train")
        return step

    def restore_rng(self) -> None:
        """Last thing before the first step of a continued run, so nothing else shifts the streams."""
        if not self.continues:
            return
        state = load_rng_state(self.source)
        if state is None:
            _say(f"{self.source} holds no RNG state for this rank (written by fewer ranks): generators left as seeded")
        else:
            set_rng_state(state)

    def step_end(self, step: int, record: dict) -> None:
        """Count the step; save (and rotate) every `save_every` steps and at `train.max_steps`
        (unless `save_final` is off)."""
        self.counters["completion_tokens"] += int(record.get("completion_tokens", 0))
        self.counters["skipped_steps"] += int(record.get("skipped_step", 0))
        every = self.ckpt.save_every
        final = step == self.cfg.train.max_steps and self.ckpt.save_final
        if (every and step % every == 0) or final:
            self.save(step, record)

    def _update_best(self, step: int, record: dict) -> None:
        metric = self.ckpt.metric_for_best_model
        if metric is None:
            return
        value = record.get(metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            if not self._warned_missing_metric:
                _say(f"metric_for_best_model {metric!r} has no finite value at step {step} "
                     f"(step metrics: {sorted(record)}); such checkpoints are not ranked")
                self._warned_missing_metric = True
            return
        best = self.best
        if best is None or (value > best["value"] if self.ckpt.greater_is_better else value < best["value"]):
            self.best = {"metric": metric, "value": value, "step": step, "checkpoint": f"checkpoint-{step}"}

    def save(self, step: int, record: dict) -> Path:
        self._update_best(step, record)
        parts = self.parts
        trainer_state = {
            "step": step,
            "config": config_to_dict(self.cfg),
            "data_stream": parts.stream.state_dict(),
            "best": self.best,
            "counters": self.counters,
            "wandb_run_id": self.wandb_run_id,
            "metrics": record,
        }
        path = save_checkpoint(self.output_dir, step, parts, trainer_state)
        self.last_saved_step = step
        _say(f"saved {path}")
        if self.ckpt.save_total_limit:
            keep = {self.best["step"]} if self.best else set()
            for removed in rotate_checkpoints(self.output_dir, self.ckpt.save_total_limit, keep):
                _say(f"removed {removed.name} (save_total_limit={self.ckpt.save_total_limit})")
        if step < self.cfg.train.max_steps:
            self._warn_if_the_next_save_cannot_fit(path)
        return path

    def _warn_if_the_next_save_cannot_fit(self, path: Path) -> None:
        if process_rank() != 0:
            return
        size, free = checkpoint_bytes(path) / 1e6, free_mb(self.output_dir)
        if free < size:
            _say(f"WARNING: {free:.0f} MB free in {self.output_dir}, {path.name} took {size:.0f} MB: the next save "
                 "will not fit and will stop the run; free some space (or lower checkpoint.save_total_limit)")


def _newest_intact_before(path: Path) -> Path | None:
    """The newest complete checkpoint beside `path` (a checkpoint-N) with a smaller step that verifies."""
    match = CHECKPOINT_NAME.match(Path(path).name)
    if match is None:
        return None
    for ckpt in reversed(list_checkpoints(Path(path).parent)):
        if ckpt.step < int(match.group(1)):
            try:
                verify_checkpoint(ckpt.path)
                return ckpt.path
            except CheckpointError:
                continue
    return None
