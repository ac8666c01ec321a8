"""Offline rollout dumps: sample a dataset's prompts with the engine and score them, no training.

The same pieces as a training step (opsd/pipeline.py's prompts, engine and sequences, then
`Scoring`) and the same file format (`opsd.dumps.record`), so offline dumps of checkpoints and the
dumps of a run compare directly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from opsd.config import Config, ConfigError, ModelConfig
from opsd.data.dataset import split_samples
from opsd.device import resolve_device
from opsd.dumps.record import recorder_for
from opsd.modeling import load_model, load_processor, prepare_model_dir
from opsd.pipeline import rollout_examples, sample_rollout
from opsd.prompts import is_multimodal
from opsd.rollout import make_engine
from opsd.scoring import Scoring, check_scoring_matches_forward
from opsd.sequences import prompt_length_check
from opsd.trainer.checkpoint import (
    MODEL_DIR, TEACHER_DIR, CheckpointError, read_trainer_state, resolve_checkpoint, verify_checkpoint,
)
from opsd.trainer.console import native_output_to_log
from opsd.teacher import (
    INITIAL_WEIGHTS, TEACHER_DIR_WEIGHTS, TEACHER_PATH_WEIGHTS, VocabView, check_teacher, head_rows, saved_weights,
    teacher_class, teacher_loader,
)

@dataclasses.dataclass
class ModelDirs:
    student: str
    teacher: str | None = None
    """None: the student's weights also score the teacher prompts."""
    step: int = 0
    """Step number of the dump file: the checkpoint's step (0 for a model directory)."""


def resolve_model_dirs(path: str | Path) -> ModelDirs:
    """A Hugging Face model directory (it scores both roles), or an opsd checkpoint (a run directory:
    its newest one), read through its manifest: the student from `model/`, the teacher as the run
    had it: `ema` from `teacher/`, `self` the student, `fixed` the run's initial weights (the
    `model.path` of the run's config), `model` the manifest's teacher path. A teacher that cannot be
    found stops with a message."""
    path = Path(path)
    if (path / "config.json").is_file():
        return ModelDirs(str(path))
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointError as err:
        raise FileNotFoundError(f"--checkpoint {path}: not a Hugging Face model directory (no config.json), "
                                f"and {err}") from None
    manifest = verify_checkpoint(checkpoint)
    student, mode = checkpoint / MODEL_DIR, manifest["teacher_mode"]
    try:
        where = saved_weights(mode)
    except ValueError as err:
        raise FileNotFoundError(f"--checkpoint {checkpoint}: {err}") from None
    if (student / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint} holds a LoRA adapter: `python -m opsd.export --checkpoint {checkpoint} "
            "--out DIR --merge` writes a full model directory to dump from"
        )
    if where == TEACHER_DIR_WEIGHTS:
        teacher = checkpoint / TEACHER_DIR
    elif where == INITIAL_WEIGHTS:
        teacher = initial_weights(checkpoint, mode)
    elif where == TEACHER_PATH_WEIGHTS:
        teacher = manifest["teacher"]["path"]
    else:  # STUDENT_WEIGHTS: the student's weights score both roles
        teacher = None
    return ModelDirs(str(student), str(teacher) if teacher else None, manifest["step"])


def initial_weights(checkpoint: Path, mode: str) -> str:
    """Where the teacher of a run whose teacher is its initial weights (`fixed`) came from: its
    `model.path` (the checkpoint holds no copy of those weights)."""
    run_cfg = read_trainer_state(checkpoint)["config"]
    if run_cfg["checkpoint"]["resume_model_only"]:
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: the run's {mode} teacher started from the weights of checkpoint "
            f"{run_cfg['checkpoint']['resume_from']!r} (checkpoint.resume_model_only), which this checkpoint does not "
            "hold; dump that checkpoint's model/ with --model to score with those weights"
        )
    model_path = run_cfg["model"]["path"]
    try:
        return prepare_model_dir(ModelConfig(path=model_path))
    except ConfigError:
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: teacher.mode={mode}, so the teacher is the run's initial weights, "
            f"model.path {model_path!r}, which is not a model directory here (relative paths are read from the "
            "current directory: run from the run's working directory)"
        ) from None


def load_split(cfg: Config, split: str, num_samples: int, processor) -> list:
    """The first usable `num_samples` rows of the datasets' `train` or `eval` splits."""
    if split not in ("train", "eval"):
        raise ConfigError(f"--split must be train or eval (got {split!r})")
    check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    return split_samples(cfg, num_samples, split=split, check=check, multimodal=is_multimodal(processor))[0]


def dump_rollouts(cfg: Config, out_dir: str | Path, *, num_samples: int, split: str = "train",
                  teacher_path: str | None = None, step: int = 0, log_file: Path | None = None) -> tuple[Path, dict[str, int]]:
    """Sample the first `num_samples` prompts of `split`, score with both roles, write one dump file.
    `log_file`: where what the engine prints while it starts goes (None: the console).

    Returns the file and the counts of completions dropped or truncated on the way.
    """
    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    if teacher_path is None and teacher_class(cfg.teacher, lora_student=False).SAVED_WEIGHTS == TEACHER_PATH_WEIGHTS:
        teacher_path = cfg.teacher.path  # a model teacher configured for a model directory's dump
    if teacher_path is not None:  # another model's tokenizer stops here, before any weights
        check_teacher(dataclasses.replace(cfg.teacher, mode="model", path=teacher_path, build=None), cfg.model, processor)
    samples = load_split(cfg, split, num_samples, processor)
    with native_output_to_log(log_file):
        engine = make_engine(cfg, model_dir, processor)
    try:
        rollout = sample_rollout(engine, samples, processor, cfg, step)
    finally:
        engine.close()
    examples, counts = rollout_examples(rollout, processor, cfg)
    if not examples:
        raise RuntimeError(f"no completion left to score ({counts})")

    device = resolve_device(cfg.train.device)
    student = load_model(cfg.model, processor, device).eval()
    check_scoring_matches_forward(student)
    teacher = student
    if teacher_path is not None:  # a model teacher in its dtype, scored over the student's vocabulary
        teacher_cfg = dataclasses.replace(cfg.teacher, mode="model", path=teacher_path, build=None)
        teacher = teacher_loader(cfg.model, processor, device)(teacher_cfg)
        if head_rows(teacher) > head_rows(student):
            teacher = VocabView(teacher, head_rows(student))
    recorder = recorder_for(cfg)
    with torch.no_grad():
        for micro, scored in Scoring.from_config(cfg, processor).examples(student, teacher, examples):
            recorder.collect(micro, scored)
    return recorder.write(Path(out_dir), step, examples, samples, processor, cfg.prompts), counts
