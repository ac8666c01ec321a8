"""Retention: what the model knew before training and the training data does not teach.

Measured at step 0 and at every evaluation (`eval.retention`), beside the task's accuracy, so that a
run shows what it costs as well as what it gains (forgetting is what on-policy self-distillation is
known to limit). Two probes, each optional:

- `eval/retention_nll`: the student's mean negative log-likelihood per token (nats) of a text no
  task trains on (by default the Apache License 2.0 that transformers ships), scored by the
  trainer's own model in pieces of `chunk_tokens`, each one forward. Deterministic: it moves only
  when the weights do.
- `eval/retention_accuracy`: the share of general-knowledge questions (`opsd.data.retention_questions`)
  answered right, greedily, by the rollout engine (which holds the same weights).

Under torchrun every rank takes its share of pieces and questions and the sums are reduced, so all
ranks return the same; a rank with no piece left still joins the sharded forward.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from opsd.config import ConfigError, PromptConfig, RetentionConfig
from opsd.data.retention_questions import answered_right, load_questions
from opsd.data.sample import Sample
from opsd.loss import token_logprobs
from opsd.prompts import Prompt, placeholder_token_ids, student_prompt
from opsd.rollout.engine import SamplingSettings, generate_once
from opsd.scoring import autocast, completion_logits
from opsd.sequences import EncodedPrompt, collate

PACKAGE_FILE = re.compile(r"(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*):(?P<file>[^:]+)")
"""`eval.retention.text` as `package:file`: a file an installed distribution ships."""


def text_source(source: str) -> Path:
    """The file `eval.retention.text` names: a distribution's file (`package:file`, matched by the end
    of its path, the distribution's own metadata files first, then the shortest path) or a path."""
    match = PACKAGE_FILE.fullmatch(source)
    if match is None or Path(source).is_file():
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"eval.retention.text: no file {source!r} (give a path or package:file)")
        return path
    package, name = match["package"], match["file"].strip("/")
    try:
        distribution = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"eval.retention.text: package {package!r} is not installed "
                          "(name another package:file, a path, or null to turn the text probe off)") from None
    found = [f for f in distribution.files or [] if f.as_posix() == name or f.as_posix().endswith("/" + name)]
    if not found:
        raise ConfigError(f"eval.retention.text: the installed {package} {distribution.version} ships no file "
                          f"{name!r} (name another package:file, a path, or null to turn the text probe off)")
    found.sort(key=lambda f: (".dist-info/" not in f.as_posix(), len(f.parts)))
    return Path(distribution.locate_file(found[0]))


def text_pieces(source: str, tokenizer, max_tokens: int, piece_tokens: int) -> list[list[int]]:
    """The text's first `max_tokens` token ids, in pieces of `piece_tokens` (the last one may be
    shorter; a piece of one token predicts nothing and is dropped)."""
    path = text_source(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"eval.retention.text: cannot read {path} as UTF-8 text: {err}") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    pieces = [ids[i : i + piece_tokens] for i in range(0, len(ids), piece_tokens)]
    pieces = [p for p in pieces if len(p) > 1]
    if not pieces:
        raise ConfigError(f"eval.retention.text: {path} holds fewer than two tokens")
    return pieces


@torch.no_grad()
def text_nll(model, pieces: list[list[int]], *, pad_id: int, dtype: str = "float32", ranks=None) -> float:
    """Mean negative log-likelihood per predicted token of `pieces` under `model` (eval mode)."""
    rank, world_size = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    mine = pieces[rank::world_size]
    rounds = -(-len(pieces) // world_size)  # the same number of forwards on every rank (FSDP gathers in them)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for i in range(rounds):
            piece = mine[i] if i < len(mine) else pieces[0]
            batch = collate([EncodedPrompt(piece[:1])], [piece[1:]], pad_id)
            with autocast(device, dtype):
                logits = completion_logits(model, batch)
            if i < len(mine):
                total -= token_logprobs(logits.float(), batch.completion_ids.to(device)).sum().item()
                count += batch.num_tokens
    finally:
        model.train(was_training)
    if hasattr(model, "reshard"):
        model.reshard()  # a sharded trainable root keeps the gathered weights of a forward without backward
    if ranks is not None:
        total, count = ranks.sum([total, count])
    return total / count


def question_accuracy(engine, prompts: list[Prompt], answers: list[tuple[str, ...]], settings: SamplingSettings,
                      ranks=None) -> float:
    """Share of `prompts` whose greedy completion holds one of its `answers`."""
    rank, world_size = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    mine = list(range(rank, len(prompts), world_size))
    texts = generate_once([[prompts[i] for i in mine]], engine, settings)[0]
    right = sum(answered_right(text, answers[i]) for text, i in zip(texts, mine, strict=True))
    if ranks is not None:
        (right,) = ranks.sum([right])
    return right / len(prompts)


@dataclass
class RetentionProbe:
    """The configured probes, prepared once (text tokenised, question prompts rendered)."""

    pieces: list[list[int]]
    prompts: list[Prompt]
    answers: list[tuple[str, ...]]
    settings: SamplingSettings
    pad_id: int
    dtype: str

    @classmethod
    def build(cls, cfg: RetentionConfig, processor, dtype: str = "float32") -> "RetentionProbe":
        tokenizer = getattr(processor, "tokenizer", processor)
        pieces = text_pieces(cfg.text, tokenizer, cfg.text_tokens, cfg.chunk_tokens) if cfg.text else []
        questions = load_questions(cfg.questions) if cfg.questions else ()
        prompt_cfg = PromptConfig(system=cfg.system)
        prompts = [student_prompt(Sample(f"retention-{i}", q, [], []), processor, prompt_cfg)
                   for i, (q, _) in enumerate(questions)]
        settings = SamplingSettings(max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                                    banned_token_ids=placeholder_token_ids(processor))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(pieces, prompts, [a for _, a in questions], settings, pad_id, dtype)

    def measure(self, model, engine, ranks=None) -> dict:
        """`eval/retention_nll` (with the text probe), `eval/retention_accuracy` (with the questions)."""
        metrics = {}
        if self.pieces:
            metrics["eval/retention_nll"] = text_nll(model, self.pieces, pad_id=self.pad_id, dtype=self.dtype, ranks=ranks)
        if self.prompts:
            metrics["eval/retention_accuracy"] = question_accuracy(engine, self.prompts, self.answers, self.settings, ranks)
        return metrics
