"""Offline rollout dumps: sample a dataset's prompts with the engine and score them, no training.

The same pieces as a training step (prompts, engine, sequences, `score_micro_batch`) and the same
file format (`opsd.dumps.record`), so offline dumps of checkpoints and the dumps of a run compare
directly.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from opsd.config import Config, ConfigError
from opsd.data.dataset import split_samples
from opsd.device import resolve_device
from opsd.dumps.record import RolloutRecorder
from opsd.modeling import load_model, load_processor, prepare_model_dir
from opsd.prompts import is_multimodal, student_prompt
from opsd.rollout import make_engine, sampling_settings
from opsd.scoring import score_micro_batch
from opsd.sequences import build_sample_examples, prompt_length_check
from opsd.trainer.checkpoint import MODEL_DIR, TEACHER_DIR

# Where a checkpoint keeps its Hugging Face model directories (checked in this order): opsd's own
# layout (opsd/trainer/checkpoint.py), and `student/`, `ema/` as other trainers name them.
CHECKPOINT_STUDENT_DIRS = ("student", MODEL_DIR)
CHECKPOINT_TEACHER_DIRS = (TEACHER_DIR, "ema")


@dataclasses.dataclass
class ModelDirs:
    student: str
    teacher: str | None = None
    """None: the student's weights also score the teacher prompts."""
    step: int = 0
    """Step number of the dump file; a `checkpoint-{step}` directory gives its step."""


def resolve_model_dirs(path: str | Path) -> ModelDirs:
    """A Hugging Face model directory, or a checkpoint directory holding student (and teacher) ones."""
    path = Path(path)
    match = re.search(r"checkpoint-(\d+)$", path.name)
    step = int(match.group(1)) if match else 0
    if (path / "config.json").is_file():
        return ModelDirs(str(path), None, step)
    student = next((path / d for d in CHECKPOINT_STUDENT_DIRS if (path / d / "config.json").is_file()), None)
    if student is None:
        raise FileNotFoundError(
            f"--checkpoint {path}: neither a Hugging Face model directory (no config.json) nor a checkpoint "
            f"with one in {'/ or '.join(CHECKPOINT_STUDENT_DIRS)}/"
        )
    teacher = next((path / d for d in CHECKPOINT_TEACHER_DIRS if (path / d / "config.json").is_file()), None)
    return ModelDirs(str(student), str(teacher) if teacher else None, step)


def load_split(cfg: Config, split: str, num_samples: int, processor) -> list:
    """The first usable `num_samples` rows of the datasets' `train` or `eval` splits."""
    if split not in ("train", "eval"):
        raise ConfigError(f"--split must be train or eval (got {split!r})")
    check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    return split_samples(cfg, num_samples, split=split, check=check, multimodal=is_multimodal(processor))[0]


def dump_rollouts(cfg: Config, out_dir: str | Path, *, num_samples: int, split: str = "train",
                  teacher_path: str | None = None, step: int = 0) -> tuple[Path, dict[str, int]]:
    """Sample the first `num_samples` prompts of `split`, score with both roles, write one dump file.

    Returns the file and the counts of completions dropped or truncated on the way.
    """
    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    pad_id = getattr(processor, "tokenizer", processor).pad_token_id
    samples = load_split(cfg, split, num_samples, processor)
    engine = make_engine(cfg, model_dir, processor)
    try:
        student_prompts = [student_prompt(s, processor, cfg.prompts) for s in samples]
        completions = engine.generate(student_prompts, sampling_settings(cfg, step, processor))
    finally:
        engine.close()
    examples, counts = build_sample_examples(
        processor, cfg.prompts, samples, student_prompts, completions, cfg.train.max_forward_tokens
    )
    if not examples:
        raise RuntimeError(f"no completion left to score ({counts})")

    device = resolve_device(cfg.train.device)
    student = load_model(cfg.model, processor, device).eval()
    teacher = student
    if teacher_path is not None:
        teacher = load_model(dataclasses.replace(cfg.model, path=teacher_path), processor, device).eval()
    recorder = RolloutRecorder(top_n=cfg.logging.dump_top_n, chunk_size=cfg.loss.chunk_size)
    micro_batch_size = cfg.train.prompts_per_micro_step * cfg.rollout.samples_per_prompt
    with torch.no_grad():
        for start in range(0, len(examples), micro_batch_size):
            micro = examples[start : start + micro_batch_size]
            scored = score_micro_batch(student, teacher, micro, loss_cfg=cfg.loss, dtype=cfg.model.dtype, pad_id=pad_id)
            recorder.collect(micro, scored)
    return recorder.write(Path(out_dir), step, examples, samples, processor, cfg.prompts), counts
