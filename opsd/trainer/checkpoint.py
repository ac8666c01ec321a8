"""Checkpoint directories: write one crash-safely, find complete ones, verify, load, rotate.

`<output_dir>/checkpoint-{step}/` holds:

    model/                 the student as a Hugging Face directory (safetensors, config, processor);
                           with LoRA its adapter as a PEFT directory (+ processor)
    teacher/               the teacher the same way, when its mode keeps one (`model_dir`: the EMA);
                           a model teacher never: the manifest records its path and fingerprint
    train_state/           torch.distributed.checkpoint: model, optimizer, scheduler (+ the teacher's
                           `train_state`); with LoRA only the trainable (adapter) weights
    rng/rank-{r}.pt        each rank's RNG states
    trainer_state.json     step, config, data position, best metric, counters, wandb run id
    opsd_checkpoint.json   manifest, written last: model fingerprint, every file with its size and sha256

A save writes `checkpoint-{step}.tmp`, fsyncs every file, writes the manifest, then renames the
directory: a crash at any point leaves either no `checkpoint-{step}` or a complete one.
Leftover `.tmp` (and `.deleting`) directories are removed at the next start; a `checkpoint-{step}`
without its manifest (a save that did not finish, a manifest deleted by hand) is moved aside. A save
that fails (a full disk, any OSError) removes its `.tmp` and raises `CheckpointSaveError`, which
names the cause, the free space and the last complete checkpoint.

The training state goes through `torch.distributed.checkpoint` with the state dicts of
`torch.distributed.checkpoint.state_dict`, so the same code saves plain and FSDP2-sharded modules,
and a checkpoint loads with a different number of ranks. Without an initialised process group it
runs as a single process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from opsd import lora
from opsd.device import process_rank, process_world_size
from opsd.teacher import TEACHER_DIR_WEIGHTS, Teacher, resume_refusal, saved_weights
from opsd.trainer.rng import rng_state

FORMAT_VERSION = 1
MANIFEST = "opsd_checkpoint.json"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR, TEACHER_DIR, TRAIN_STATE_DIR, RNG_DIR = "model", "teacher", "train_state", "rng"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
LEFTOVER_NAME = re.compile(r"^checkpoint-\d+\.(tmp|deleting)$")
HASH_THREADS = 8
"""Files hashed at once when a checkpoint is written or verified (hashlib releases the GIL)."""
FAULT_ENV = "OPSD_FAULT_INJECT"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run; the message says which."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, an OSError); its `.tmp` is removed, the earlier checkpoints are intact."""


@dataclass
class TrainingParts:
    """Everything a checkpoint saves and restores besides the RNG states."""

    student: nn.Module
    teacher: Teacher
    """The teacher component (opsd/teacher.py): it says what of it a checkpoint holds."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    processor: Any
    stream: Any = None
    """The data stream; its position goes into `trainer_state.json` (see CheckpointManager)."""

    @property
    def frozen_vision(self) -> bool:
        """Whether part of a fully trained student is frozen (`model.freeze_vision`): its optimizer
        then holds no state for that part."""
        return not lora.is_lora(self.student) and not all(p.requires_grad for p in self.student.parameters())


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def checkpoint_path(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


# --- process group helpers: the same code runs with or without torch.distributed ----------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _any_rank(failed: bool) -> bool:
    """Whether any rank failed (every rank calls this: one collective)."""
    if not _distributed():
        return failed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


@contextmanager
def _single_process_quietly():
    """DCP warns on every single-process save or load; that is an intended mode here, not a slip."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fault_point(stage: str, step: int) -> None:
    """Test-only: `OPSD_FAULT_INJECT=save:<stage>[@<step>]` SIGKILLs the process at this point."""
    spec = os.environ.get(FAULT_ENV, "")
    where, _, at = spec.partition("@")
    if where == f"save:{stage}" and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


# --- finding checkpoints ------------------------------------------------------------------------

def list_checkpoints(output_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints (renamed into place, manifest present) in `output_dir`, oldest first."""
    found = []
    if Path(output_dir).is_dir():
        for entry in Path(output_dir).iterdir():
            match = CHECKPOINT_NAME.match(entry.name)
            if match and (entry / MANIFEST).is_file():
                found.append(Checkpoint(int(match.group(1)), entry))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(output_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Delete half-written saves and half-deleted checkpoints left by a crash (rank 0 only)."""
    removed = []
    if process_rank() == 0 and Path(output_dir).is_dir():
        for entry in sorted(Path(output_dir).iterdir()):
            if entry.is_dir() and LEFTOVER_NAME.match(entry.name):
                shutil.rmtree(entry)
                removed.append(entry)
    _barrier()
    return removed


def incomplete_checkpoints(output_dir: Path) -> list[Path]:
    """`checkpoint-{step}` directories without a manifest: saves that did not finish (or whose
    manifest was deleted). The save of that step would collide with them."""
    if not Path(output_dir).is_dir():
        return []
    return sorted(
        entry for entry in Path(output_dir).iterdir()
        if entry.is_dir() and CHECKPOINT_NAME.match(entry.name) and not (entry / MANIFEST).is_file()
    )


def move_aside(paths: list[Path], label: str) -> list[tuple[Path, Path]]:
    """Rename each directory to `<name>.<label>-<time>` (rank 0; never deletes); (old, new) pairs."""
    moved = []
    if process_rank() == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in paths:
            target = path.with_name(f"{path.name}.{label}-{stamp}")
            os.rename(path, target)
            moved.append((path, target))
    _barrier()
    return moved


def checkpoint_bytes(path: Path) -> int:
    """The size of a complete checkpoint's files, from its manifest."""
    return sum(record["size"] for record in read_manifest(path)["files"].values())


def free_mb(path: Path) -> float:
    """Free space (MB, 1e6 bytes) of the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 1e6


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint, else the newest complete checkpoint inside it."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if CHECKPOINT_NAME.match(path.name) and path.is_dir():
        raise CheckpointError(f"{path} is incomplete: {MANIFEST} is missing (the save did not finish)")
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(f"no opsd checkpoint at {path}: neither {MANIFEST} nor complete checkpoint-* directories")
    return newest.path


# --- saving -------------------------------------------------------------------------------------

def model_fingerprint(model: nn.Module) -> dict:
    """What a checkpoint's weights fit: model type, architectures, every state-dict entry's shape."""
    config = getattr(model, "config", None)
    return {
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "parameters": {name: list(t.shape) for name, t in get_model_state_dict(model).items()},
    }


def _state_options(model: nn.Module) -> StateDictOptions:
    # A LoRA run's frozen base weights are model.path's: saving them would only cost time and disk.
    # Loading then cannot be strict about them; the trainable ones are still all required, since
    # the state DCP fills is built from exactly those and DCP refuses keys the checkpoint lacks.
    if lora.is_lora(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def _train_state(parts: TrainingParts) -> dict:
    """The `torch.distributed.checkpoint` state: sharded or plain, whatever the modules are."""
    model_state, optim_state = get_state_dict(parts.student, parts.optimizer, options=_state_options(parts.student))
    state = {"model": model_state, "optimizer": optim_state, "scheduler": parts.scheduler.state_dict()}
    teacher_state = parts.teacher.train_state()
    if teacher_state is not None:
        state["teacher"] = teacher_state
    return state


def _save_hf_dir(model: nn.Module, processor, path: Path, *, adapter: str = lora.STUDENT_ADAPTER) -> None:
    """A `from_pretrained` / `vllm.LLM` directory (a LoRA model: its `adapter` as a PEFT directory);
    the full weights are gathered onto rank 0."""
    if lora.is_lora(model):
        lora.save_adapter(model, path, adapter=adapter, write=process_rank() == 0)
        if process_rank() == 0:
            processor.save_pretrained(path)
        return
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=_distributed()))
    if process_rank() == 0:
        model.save_pretrained(path, state_dict=full)
        processor.save_pretrained(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    """The file's sha256, streamed in 8 MiB blocks: one pass, constant memory, whatever its size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record(path: Path) -> dict:
    """A written file's size and sha256, fsynced. Read right after it was written, it is in the page
    cache: the hash costs one pass over memory, not a second read of the disk."""
    _fsync(path)
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _file_records(root: Path) -> dict[str, dict]:
    """Every file under `root` with its size and sha256 (files hashed in parallel), each fsynced."""
    paths = []
    for dirpath, _, filenames in os.walk(root):
        paths += [Path(dirpath) / name for name in filenames]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        records = dict(zip((str(p.relative_to(root)) for p in paths), pool.map(_record, paths)))
    for dirpath, _, _ in os.walk(root):
        _fsync(Path(dirpath))
    return dict(sorted(records.items()))


def save_checkpoint(output_dir: Path, step: int, parts: TrainingParts, trainer_state: dict) -> Path:
    """Write `checkpoint-{step}` crash-safely; every rank calls this (the gathers are collective).

    Before writing, rank 0 checks that the free space holds another checkpoint the size of the
    newest one. A failure on any rank ends the save on every rank (they agree after each phase):
    the `.tmp` is removed and `CheckpointSaveError` names the cause when it is the disk or the file
    system (any other error is raised as it is).
    """
    final = checkpoint_path(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        _in_step(_check_finite_weights, parts, step)
        _in_step(_begin_save, output_dir, step, tmp)
        _in_step(_write_states, tmp, step, parts)
        _in_step(_commit, tmp, final, step, parts, trainer_state)
    except (Exception, CheckpointException) as err:
        error = save_error(output_dir, step, err)  # before the cleanup frees the space the save took
        if process_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error from err
    return final


class _OtherRankFailed(Exception):
    """This rank's part of a save went well, another rank's did not (that rank names the cause)."""


def _in_step(phase, *args) -> None:
    """Run one phase of a save on this rank, then learn whether it went well on every rank."""
    error = None
    try:
        phase(*args)
    except (Exception, CheckpointException) as err:
        error = err
    if _any_rank(error is not None):
        raise error if error is not None else _OtherRankFailed()


def _check_finite_weights(parts: TrainingParts, step: int) -> None:
    """A checkpoint is never written with NaN or inf weights (this rank's shards of the student and
    of a teacher copy): resuming from one would only train on NaN."""
    modules = [("the student", parts.student)]
    if parts.teacher.module is not None:
        modules.append(("the teacher", parts.teacher.module))
    for role, module in modules:
        for name, param in module.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(local.detach()).all()):
                raise CheckpointError(f"not saving checkpoint-{step}: {role}'s {name} holds non-finite values (NaN or inf)")


def _begin_save(output_dir: Path, step: int, tmp: Path) -> None:
    if process_rank() != 0:
        return
    final = checkpoint_path(output_dir, step)
    if final.exists():
        raise CheckpointError(f"{final} already exists; a checkpoint is never overwritten")
    previous = latest_checkpoint(output_dir)
    if previous is not None and free_mb(output_dir) < checkpoint_bytes(previous.path) / 1e6:
        raise CheckpointSaveError(
            f"saving checkpoint-{step} to {output_dir} failed before writing: not enough free space for a "
            f"checkpoint the size of {previous.path.name} ({checkpoint_bytes(previous.path) / 1e6:.0f} MB)"
            f"{_state_of_disk(output_dir)}"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / RNG_DIR).mkdir(parents=True)


def _write_states(tmp: Path, step: int, parts: TrainingParts) -> None:
    _save_hf_dir(parts.student, parts.processor, tmp / MODEL_DIR)
    teacher_dir = parts.teacher.model_dir(parts.student)
    if teacher_dir is not None:
        module, adapter = teacher_dir
        _save_hf_dir(module, parts.processor, tmp / TEACHER_DIR, adapter=adapter)
    _fault_point("model", step)
    with _single_process_quietly():
        dcp.save(_train_state(parts), checkpoint_id=tmp / TRAIN_STATE_DIR)
    _fault_point("train_state", step)
    torch.save(rng_state(), tmp / RNG_DIR / f"rank-{process_rank()}.pt")


def _commit(tmp: Path, final: Path, step: int, parts: TrainingParts, trainer_state: dict) -> None:
    if process_rank() != 0:
        return
    _write_json(tmp / TRAINER_STATE, trainer_state)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "teacher_mode": parts.teacher.mode,
        **({"teacher": identity} if (identity := parts.teacher.identity()) else {}),
        "frozen_vision": parts.frozen_vision,
        "world_size": process_world_size(),
        "model": model_fingerprint(parts.student),
        "files": _file_records(tmp),
    }
    _write_json(tmp / MANIFEST, manifest)
    _fault_point("commit", step)
    os.rename(tmp, final)  # the commit: atomic, so the checkpoint is either absent or complete
    _fsync(final.parent)


# --- why a save failed --------------------------------------------------------------------------

DISK_FULL_MB = 1.0
"""Free space below this after a failed write (measured before its `.tmp` is removed): the disk was
full, whatever error the writer raised."""
_WRITER_FAILURES = ("inline_container", "IoError", "No space left", "os error", "Disk quota")
"""Words of the errors torch.save's zip writer and safetensors raise for a failed write (no OSError)."""


def _causes(err: BaseException):
    """`err`, its chained causes, and the per-rank failures a DCP CheckpointException wraps."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]


def _state_of_disk(output_dir: Path) -> str:
    latest = latest_checkpoint(output_dir)
    return (f"; free space: {free_mb(output_dir):.0f} MB; the last complete checkpoint is "
            f"{latest.path.name if latest else 'none'}. Free some space (or choose another logging.output_dir), "
            "then rerun with checkpoint.resume_from=auto")


def save_error(output_dir: Path, step: int, err: BaseException) -> BaseException:
    """What a failed save ends with: `CheckpointSaveError` naming the cause, the free space and the
    last complete checkpoint when the disk or the file system failed; `err` itself otherwise."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, _OtherRankFailed):
        return CheckpointSaveError(f"saving checkpoint-{step} to {output_dir} failed on another rank (its error names the cause)")
    causes = list(_causes(err))
    os_error = next((e for e in causes if isinstance(e, OSError) and e.errno), None)
    writer_error = next((e for e in reversed(causes) if any(word in str(e) for word in _WRITER_FAILURES)), None)
    if os_error is not None:
        where = f" ({Path(os_error.filename).name})" if os_error.filename else ""
        cause = f"{os.strerror(os_error.errno)}{where}"
    elif free_mb(output_dir) < DISK_FULL_MB:
        cause = f"{os.strerror(errno.ENOSPC)} ({_one_line(writer_error or causes[-1])})"
    elif writer_error is not None:
        cause = _one_line(writer_error)
    else:
        return err  # not the disk: a bug, with its traceback
    return CheckpointSaveError(f"saving checkpoint-{step} to {output_dir} failed: {cause}{_state_of_disk(output_dir)}")


def _one_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}"


# --- verifying and loading ----------------------------------------------------------------------

def read_manifest(path: Path) -> dict:
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a complete opsd checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path} is corrupt: {err}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format version {manifest.get('format_version')}, this opsd reads {FORMAT_VERSION}")
    return manifest


def verify_checkpoint(path: Path, *, under: str = "") -> dict:
    """The manifest, after checking that every file it lists (below `under`) is there, of its size,
    and with its content hash (every file; checkpoints of older opsd hashed only files up to 16 MiB)."""
    manifest = read_manifest(path)
    listed = {rel: record for rel, record in manifest["files"].items() if rel.startswith(under)}
    for rel, record in listed.items():
        file = Path(path) / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} is missing")
        if file.stat().st_size != record["size"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} has {file.stat().st_size} bytes, the manifest says {record['size']}")
    hashed = [rel for rel, record in listed.items() if "sha256" in record]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for rel, digest in zip(hashed, pool.map(lambda rel: _sha256(Path(path) / rel), hashed)):
            if digest != listed[rel]["sha256"]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {rel} differs from the file that was saved (sha256)")
    return manifest


def read_trainer_state(path: Path) -> dict:
    file = Path(path) / TRAINER_STATE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read {TRAINER_STATE}: {err}") from None


def check_model_fits(path: Path, manifest: dict, model: nn.Module) -> None:
    """Stop with a message naming the difference when the checkpoint holds another model's weights."""
    saved, current = manifest["model"], model_fingerprint(model)
    if saved["model_type"] != current["model_type"]:
        raise CheckpointError(
            f"checkpoint {path} holds a {saved['model_type']} model ({saved['architectures']}), "
            f"this run's model.path is {current['model_type']} ({current['architectures']})"
        )
    missing = sorted(set(saved["parameters"]) - set(current["parameters"]))
    extra = sorted(set(current["parameters"]) - set(saved["parameters"]))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: parameters only in the checkpoint {missing[:5]}, "
            f"only in the model {extra[:5]}"
        )
    for name, shape in saved["parameters"].items():
        if shape != current["parameters"][name]:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: {name} has shape {shape} in the checkpoint, "
                f"{current['parameters'][name]} in the model"
            )


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with _single_process_quietly():
            dcp.load(state, checkpoint_id=Path(path) / TRAIN_STATE_DIR)
    except (Exception, CheckpointException) as err:  # DCP raises several types; name the checkpoint, keep the cause
        raise CheckpointError(f"checkpoint {path}: {TRAIN_STATE_DIR}/ cannot be loaded into this run: {err}") from err


def load_checkpoint(path: Path, parts: TrainingParts, *, weights_only: bool = False, from_ema: bool = False) -> dict:
    """Restore `parts` from a checkpoint (RNG states excepted) and return its manifest.

    `weights_only`: the student's weights alone (`from_ema`: the EMA teacher's), nothing else.
    """
    manifest = verify_checkpoint(path)
    check_model_fits(path, manifest, parts.student)
    saved_mode = manifest["teacher_mode"]
    if weights_only:
        if from_ema and _saved_weights(path, saved_mode) != TEACHER_DIR_WEIGHTS:
            raise CheckpointError(f"checkpoint {path} has no EMA weights: it was written with teacher.mode={saved_mode}")
        key = "teacher" if from_ema else "model"
        options = _state_options(parts.student)
        state = {key: get_model_state_dict(parts.student, options=options)}
        _dcp_load(state, path)
        set_model_state_dict(parts.student, state[key], options=options)
        return manifest
    refusal = resume_refusal(parts.teacher, saved_mode, manifest.get("teacher"))
    if refusal:
        raise CheckpointError(f"checkpoint {path}: {refusal}")
    if manifest.get("frozen_vision", False) and not parts.frozen_vision:
        raise CheckpointError(
            f"checkpoint {path} was written with model.freeze_vision=true: its optimizer holds no state for the "
            "vision tower this run trains; resume with model.freeze_vision=true, or start from its weights "
            "(checkpoint.resume_model_only=true)"
        )
    state = _train_state(parts)
    _dcp_load(state, path)
    set_state_dict(parts.student, parts.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_state_options(parts.student))
    if "teacher" in state:
        parts.teacher.load_train_state(state["teacher"])
    parts.scheduler.load_state_dict(state["scheduler"])
    return manifest


def _saved_weights(path: Path, saved_mode: str) -> str:
    """Where the checkpoint at `path` keeps its teacher's weights (see opsd/teacher.py)."""
    try:
        return saved_weights(saved_mode)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None


def load_rng_state(path: Path) -> dict | None:
    """This rank's saved RNG states; None when the checkpoint was written by fewer ranks."""
    file = Path(path) / RNG_DIR / f"rank-{process_rank()}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None


# --- rotation -----------------------------------------------------------------------------------

def rotate_checkpoints(output_dir: Path, limit: int, keep_steps: set[int] = frozenset()) -> list[Path]:
    """Delete the oldest checkpoints beyond `limit`, never the newest nor those in `keep_steps`.

    A checkpoint is first renamed to `.deleting` (atomic), so a crash mid-delete never leaves a
    half-deleted directory that looks complete.
    """
    if process_rank() != 0:
        return []
    found = list_checkpoints(output_dir)
    if not found:
        return []
    protected = set(keep_steps) | {found[-1].step}
    excess = len(found) - limit
    removed = []
    for ckpt in found:
        if excess <= 0:
            break
        if ckpt.step in protected:
            continue
        doomed = ckpt.path.with_name(ckpt.path.name + ".deleting")
        os.rename(ckpt.path, doomed)
        shutil.rmtree(doomed)
        removed.append(ckpt.path)
        excess -= 1
    return removed
