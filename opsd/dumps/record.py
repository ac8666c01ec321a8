"""Rollout dumps: a step's sampled completions with per-token scores, one parquet file per rank.

`<dir>/step_{N}_rank_{R}.parquet` holds one row per completion the step trained on (or, offline,
scored); `datasets.load_dataset("parquet", data_files=...)` and pandas read it. Columns:

    step, rank, index                 int    the step, the writing rank, the completion's place in the file
    sample_id, prompt, teacher_prompt string the sample and both chat-templated prompt texts
    images, teacher_images            list<string>  image references, never pixels:
                                      `{sample_id}/{field}/{i}[:noise-{kind}]@sha256:{16 hex}`
    answer, predicted_answer          string (null when unknown / no match of `eval.answer_pattern`)
    correct                           bool   (null when the sample has no answer)
    completion_ids, completion_tokens list<int32>, list<string> (each token decoded alone)
    completion_text, num_tokens       string, int
    engine_logprobs                   list<float32>  the sampler's logprob of each sampled token
    student_logprobs, teacher_logprobs list<float32> both roles' logprob of it (temperature 1)
    divergence                        list<float32>  the per-token distillation term of the loss
                                      (generalized JSD, or the tinker per-token loss)
    teacher_top_ids/_probs/_tokens    list<list<...>> the teacher's n most likely next tokens and
                                      their full-vocabulary probabilities (only when top_n > 0)

The numbers are the very tensors the step computed (float32): the divergences of all ranks' files
of a step sum to `jsd * completion_tokens` (`tinker_loss` under the tinker loss) of that step's metrics, and |engine - student| gives its
`logprob_mismatch_*`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from opsd import evaluation
from opsd.config import Config, EvalConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.device import process_rank
from opsd.loss import token_logprobs
from opsd.loss_kinds import build_loss
from opsd.prompts import student_prompt, teacher_prompt, tokenizer_of
from opsd.scoring import ScoredBatch
from opsd.sequences import Example

ROLLOUTS_SUBDIR = "rollouts"
"""Where a run's dumps go, under its output directory."""
DUMP_FILE = "step_{step}_rank_{rank}.parquet"
"""A dump file's name (`DUMP_FILE.format(step="*", rank="*")` globs them); `parse_dump_name` reads it."""
_DUMP_NAME = re.compile(DUMP_FILE.replace(".", r"\.").format(step=r"(\d+)", rank=r"(\d+)"))

# Dumps judge answers the way evaluation does (opsd/evaluation.py), with the run's `eval.answer_pattern`.
_DEFAULT_PATTERN = EvalConfig.answer_pattern


def extract_answer(text: str, pattern: str = _DEFAULT_PATTERN) -> str | None:
    """The last match of `pattern` in `text` (`<answer>...</answer>` by default), stripped; None without one."""
    found = evaluation.extract_answer(text, pattern)
    return found.strip() if found is not None else None


def answer_is_correct(completion_text: str, answer: str | None, pattern: str = _DEFAULT_PATTERN) -> bool | None:
    """None when the answer is unknown; False when the completion has no match of `pattern`."""
    if answer is None:
        return None
    return evaluation.is_correct(completion_text, answer, pattern)


@dataclass
class TokenScores:
    """Per-token values of one completion, float32 numpy arrays of its length."""

    engine_logprobs: np.ndarray
    student_logprobs: np.ndarray
    teacher_logprobs: np.ndarray
    divergence: np.ndarray
    teacher_top_ids: np.ndarray | None = None  # [len, n] int
    teacher_top_probs: np.ndarray | None = None  # [len, n] float32


@torch.no_grad()
def teacher_top_n(teacher_logits: torch.Tensor, n: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [N, n] and full-softmax probabilities [N, n] of the n largest logits per row.

    Row chunks bound the float32 working copy to [chunk_size, V] (the loss does the same); top-k
    runs on the logits' own dtype.
    """
    ids, probs = [], []
    for rows in teacher_logits.split(chunk_size):
        values, top = rows.topk(min(n, rows.shape[-1]), dim=-1)
        log_z = torch.logsumexp(rows.float(), dim=-1, keepdim=True)
        ids.append(top)
        probs.append((values.float() - log_z).exp())
    return torch.cat(ids), torch.cat(probs)


@torch.no_grad()
def token_scores(micro: list[Example], scored: ScoredBatch, *, top_n: int, chunk_size: int) -> list[TokenScores]:
    """Split one scored micro-batch into per-completion TokenScores (completions are contiguous)."""
    teacher_lp = token_logprobs(scored.teacher_logits, scored.sampled_ids, chunk_size=chunk_size)
    columns = [scored.engine_logprobs, scored.student_logprobs.detach(), teacher_lp, scored.distill.detach()]
    if top_n > 0:
        columns += teacher_top_n(scored.teacher_logits, top_n, chunk_size)
    lengths = [len(e.completion_ids) for e in micro]
    per_column = [c.float().cpu().numpy() if c.is_floating_point() else c.cpu().numpy() for c in columns]
    splits = np.cumsum(lengths)[:-1]
    return [TokenScores(*parts) for parts in zip(*(np.split(c, splits) for c in per_column))]


def image_refs(sample: Sample, images, prompt_cfg: PromptConfig, *, teacher: bool) -> list[str]:
    """`{sample_id}/{field}/{i}[:noise-{kind}]@sha256:{16 hex}` for a prompt's images, in prompt order."""
    names = [f"images/{i}" for i in range(len(sample.images))]
    if teacher and "images" in prompt_cfg.privileged:
        noise = f":noise-{prompt_cfg.noise}" if prompt_cfg.noise != "off" else ""
        names += [f"privileged_images/{i}{noise}" for i in range(len(sample.privileged_images))]
    return [
        f"{sample.id}/{name}@sha256:{hashlib.sha256(img.tobytes()).hexdigest()[:16]}"
        for name, img in zip(names, images, strict=True)
    ]


def _token_texts(tokenizer, ids: np.ndarray | list[int]) -> dict[int, str]:
    unique = sorted({int(t) for t in np.asarray(ids).ravel()})
    return dict(zip(unique, tokenizer.batch_decode([[t] for t in unique])))


def rollout_rows(
    step: int, rank: int, examples: list[Example], scores: list[TokenScores],
    samples: list[Sample], processor, prompt_cfg: PromptConfig, answer_pattern: str = _DEFAULT_PATTERN,
) -> list[dict]:
    """One dict per completion in the dump schema (see the module docstring); answers are judged
    with `answer_pattern` (the run's `eval.answer_pattern`)."""
    if len(examples) != len(scores):
        raise ValueError(f"{len(examples)} examples but {len(scores)} scored completions")
    tokenizer = tokenizer_of(processor)
    by_id = {s.id: s for s in samples}
    prompts = {}
    for s in by_id.values():
        student, teacher = student_prompt(s, processor, prompt_cfg), teacher_prompt(s, processor, prompt_cfg)
        prompts[s.id] = (
            student.text, teacher.text,
            image_refs(s, student.images, prompt_cfg, teacher=False),
            image_refs(s, teacher.images, prompt_cfg, teacher=True),
        )
    texts = _token_texts(tokenizer, [t for e in examples for t in e.completion_ids] + [
        t for sc in scores if sc.teacher_top_ids is not None for t in sc.teacher_top_ids.ravel()
    ])
    rows = []
    for index, (example, sc) in enumerate(zip(examples, scores)):
        sample = by_id[example.sample_id]
        prompt, teacher_text, images, teacher_images = prompts[example.sample_id]
        completion_text = tokenizer.decode(example.completion_ids, skip_special_tokens=True)
        predicted = extract_answer(completion_text, answer_pattern)
        row = {
            "step": step, "rank": rank, "index": index, "sample_id": example.sample_id,
            "prompt": prompt, "teacher_prompt": teacher_text, "images": images, "teacher_images": teacher_images,
            "answer": sample.answer, "predicted_answer": predicted,
            "correct": answer_is_correct(completion_text, sample.answer, answer_pattern),
            "completion_ids": list(example.completion_ids),
            "completion_tokens": [texts[t] for t in example.completion_ids],
            "completion_text": completion_text, "num_tokens": len(example.completion_ids),
            "engine_logprobs": sc.engine_logprobs, "student_logprobs": sc.student_logprobs,
            "teacher_logprobs": sc.teacher_logprobs, "divergence": sc.divergence,
        }
        if sc.teacher_top_ids is not None:
            row["teacher_top_ids"] = sc.teacher_top_ids.tolist()
            row["teacher_top_probs"] = sc.teacher_top_probs.tolist()
            row["teacher_top_tokens"] = [[texts[int(t)] for t in pos] for pos in sc.teacher_top_ids]
        rows.append(row)
    return rows


_FLOATS, _STRINGS = pa.list_(pa.float32()), pa.list_(pa.string())
SCHEMA = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("index", pa.int64()), ("sample_id", pa.string()),
    ("prompt", pa.string()), ("teacher_prompt", pa.string()), ("images", _STRINGS), ("teacher_images", _STRINGS),
    ("answer", pa.string()), ("predicted_answer", pa.string()), ("correct", pa.bool_()),
    ("completion_ids", pa.list_(pa.int32())), ("completion_tokens", _STRINGS),
    ("completion_text", pa.string()), ("num_tokens", pa.int64()),
    ("engine_logprobs", _FLOATS), ("student_logprobs", _FLOATS), ("teacher_logprobs", _FLOATS), ("divergence", _FLOATS),
])
TOP_N_FIELDS = [
    ("teacher_top_ids", pa.list_(pa.list_(pa.int32()))),
    ("teacher_top_probs", pa.list_(_FLOATS)),
    ("teacher_top_tokens", pa.list_(_STRINGS)),
]


def dump_path(out_dir: Path, step: int, rank: int) -> Path:
    return Path(out_dir) / DUMP_FILE.format(step=step, rank=rank)


def parse_dump_name(name: str) -> tuple[int, int] | None:
    """(step, rank) of a dump file's name; None for any other file."""
    match = _DUMP_NAME.fullmatch(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def write_rollouts(path: Path, rows: list[dict]) -> Path:
    """Write rows to parquet under a temporary name first: a crash never leaves a half file."""
    with_top_n = bool(rows) and "teacher_top_ids" in rows[0]
    schema = pa.schema(list(SCHEMA) + (TOP_N_FIELDS if with_top_n else []))
    table = pa.Table.from_pylist(rows, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


class RolloutRecorder:
    """Collects a step's per-token scores (`collect` is train_step's `on_scored`), then writes them."""

    def __init__(self, *, top_n: int, chunk_size: int, answer_pattern: str = _DEFAULT_PATTERN):
        self.top_n, self.chunk_size, self.answer_pattern = top_n, chunk_size, answer_pattern
        self.scores: list[TokenScores] = []

    def collect(self, micro: list[Example], scored: ScoredBatch) -> None:
        self.scores += token_scores(micro, scored, top_n=self.top_n, chunk_size=self.chunk_size)

    def write(self, out_dir: Path, step: int, examples: list[Example], samples: list[Sample], processor, prompt_cfg: PromptConfig) -> Path:
        rank = process_rank()
        rows = rollout_rows(step, rank, examples, self.scores, samples, processor, prompt_cfg, self.answer_pattern)
        return write_rollouts(dump_path(out_dir, step, rank), rows)


def recorder_for_step(cfg: Config, step: int) -> RolloutRecorder | None:
    """A recorder when `logging.dump_rollouts_every` asks for this step's rollouts, else None."""
    every = cfg.logging.dump_rollouts_every
    if every == 0 or step % every:
        return None
    return recorder_for(cfg)


def recorder_for(cfg: Config) -> RolloutRecorder:
    """A recorder with the run's settings: top-n, row chunks, answer pattern."""
    return RolloutRecorder(top_n=cfg.logging.dump_top_n, chunk_size=build_loss(cfg.loss).chunk_rows,
                           answer_pattern=cfg.eval.answer_pattern)
