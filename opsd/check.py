"""The self-test: `python -m opsd.train --config X --check`, what to run first on a new model,
chat template or engine.

1. No privileged information: the teacher scores the student's own prompt with the student's
   weights. The distillation term must be 0 (to float tolerance), and the trainer's logprobs of the
   sampled tokens must match the engine's (max gap below 1e-3): a gap means the engine and the
   trainer see different sequences (chat template, tokenisation, image inputs) or weights.
   A teacher that is not the student's own weights (a model teacher, `teacher.mode: model`) is also
   scored on the student's prompt: that divergence (teacher against student, no privileged
   information) is reported as a number, not checked: it is what the teacher knows beyond the prompt.
2. With the privileged information, as configured: the divergence distillation starts from.
3. One optimizer step on those sequences, the weight sync, fresh samples: the engine must follow
   the new weights (max gap below 1e-3 again).

Single process only. What vLLM and transformers print goes to `<logging.output_dir>/check.log`
(nothing else is written there); `--verbose` shows it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opsd.config import Config, ConfigError
from opsd.data.dataset import split_samples
from opsd.device import resolve_device
from opsd.loss import GuardrailSums
from opsd.modeling import load_model, load_processor, prepare_model_dir
from opsd.pipeline import rollout_examples, sample_rollout
from opsd.prompts import is_multimodal
from opsd.rollout import make_engine
from opsd.rollout.weight_sync import sync_student
from opsd.scoring import Scoring, check_scoring_matches_forward
from opsd.sequences import Example, prompt_length_check
from opsd.teacher import check_teacher, make_teacher, teacher_loader
from opsd.trainer.console import native_output_to_log, third_party_output
from opsd.trainer.distributed import launched_by_torchrun
from opsd.trainer.optim import build_optimizer
from opsd.trainer.rng import seed_everything
from opsd.trainer.step import TrainStep

DIVERGENCE_TOLERANCE = 1e-6
"""|divergence| allowed when teacher and student score the same sequence with the same weights."""
MISMATCH_TOLERANCE = 1e-3
"""Largest |engine - trainer| logprob of a sampled token allowed."""


@dataclass
class Scores:
    divergence: float
    """Mean per-token distillation term over the completion tokens."""
    divergence_max: float
    mismatch_max: float
    tokens: int
    guardrails: dict


@torch.no_grad()
def score(scoring: Scoring, student, teacher, examples: list[Example]) -> Scores:
    """The distillation term and the engine/trainer mismatch of `examples`, without gradients."""
    distill, mismatch, sums = [], [], GuardrailSums()
    for _, scored in scoring.examples(student, teacher, examples):
        distill.append(scored.distill.float())
        mismatch.append((scored.student_logprobs - scored.engine_logprobs).abs())
        sums.add(scored.guardrails)
    distill, mismatch = torch.cat(distill), torch.cat(mismatch)
    guardrails = {name: value for name, value in sums.metrics().items() if name in scoring.loss.guardrail_names}
    return Scores(distill.mean().item(), distill.abs().max().item(), mismatch.max().item(), distill.numel(), guardrails)


CHECK_LOG = "check.log"


def run_check(cfg: Config, out=print) -> bool:
    """The three checks on one step's prompts of the training split; True when all pass."""
    if launched_by_torchrun():
        raise ConfigError("--check runs in one process: start it with `python -m opsd.train`, not torchrun")
    with third_party_output(cfg.logging.output_dir, verbose=cfg.logging.verbose, log_name=CHECK_LOG) as log_file:
        passed = _run_checks(cfg, out, log_file)
    out(f"{'check passed' if passed else 'check FAILED'} (third-party output: {log_file})")
    return passed


def _run_checks(cfg: Config, out, log_file) -> bool:
    device = resolve_device(cfg.train.device)
    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    check_teacher(cfg.teacher, cfg.model, processor)  # before any weights load
    scoring = Scoring.from_config(cfg, processor)
    length_check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    samples, _ = split_samples(cfg, cfg.prompts_per_step, split="train", check=length_check, multimodal=is_multimodal(processor))
    with native_output_to_log(None if cfg.logging.verbose else log_file):
        engine = make_engine(cfg, model_dir, processor)
    try:
        seed_everything(cfg.train.seed)
        student = load_model(cfg.model, processor, device)
        check_scoring_matches_forward(student)
        teacher = make_teacher(cfg.teacher, student, load_model=teacher_loader(cfg.model, processor, device))
        sync_student(student, engine, bucket_mb=cfg.rollout.sync_bucket_mb)  # the sync path, as a run starts
        rollout = sample_rollout(engine, samples, processor, cfg, 1)
        same, _ = rollout_examples(rollout, processor, cfg, privileged=False)
        if not same:
            out("check FAILED: no completion to score (empty completions or prompts longer than train.max_forward_tokens)")
            return False
        plain = score(scoring, student, student, same)
        plain_ok = abs(plain.divergence_max) <= DIVERGENCE_TOLERANCE and plain.mismatch_max < MISMATCH_TOLERANCE
        out(f"check 1, no privileged information (teacher prompt = student prompt, teacher = student), "
            f"{plain.tokens} tokens: divergence {plain.divergence:.3g} (max {plain.divergence_max:.3g}, must be "
            f"<= {DIVERGENCE_TOLERANCE:g}), engine/trainer logprob gap max {plain.mismatch_max:.3g} "
            f"(must be < {MISMATCH_TOLERANCE:g}): {'ok' if plain_ok else 'FAILED'}")
        if teacher.module is not None and not teacher.HOLDS_COPY:  # a model of its own: a number, no pass or fail
            other = score(scoring, student, teacher.scorer, same)
            out(f"check 1, the teacher ({teacher.mode}) on the student's prompt, {other.tokens} tokens: divergence "
                f"{other.divergence:.4g} per token (max {other.divergence_max:.3g}); another model's, not checked")

        privileged, _ = rollout_examples(rollout, processor, cfg)
        if not privileged:
            out("check FAILED: no completion fits beside the teacher's prompt (train.max_forward_tokens)")
            return False
        with_info = score(scoring, student, teacher.scorer, privileged)
        guardrails = ", ".join(f"{k} {v:.3g}" for k, v in with_info.guardrails.items())
        out(f"check 2, with privileged {'+'.join(cfg.prompts.privileged)} (teacher {teacher.mode}), "
            f"{with_info.tokens} tokens: divergence {with_info.divergence:.4g} per token (max {with_info.divergence_max:.3g}); "
            f"{guardrails}")

        TrainStep(student, teacher.scorer, build_optimizer(cfg.optim, student), scoring, cfg.optim.max_grad_norm)(privileged)
        moved = score(scoring, student, student, same).mismatch_max  # new trainer vs old engine logprobs
        sync_student(student, engine, bucket_mb=cfg.rollout.sync_bucket_mb)
        after, _ = rollout_examples(sample_rollout(engine, samples, processor, cfg, 2), processor, cfg, privileged=False)
        synced = score(scoring, student, student, after) if after else None
        synced_ok = synced is not None and synced.mismatch_max < MISMATCH_TOLERANCE
        gap = f"{synced.mismatch_max:.3g}" if synced else "nothing sampled"
        note = "" if moved > 10 * MISMATCH_TOLERANCE else " (the update moved them too little for this to show the sync)"
        out(f"check 3, one optimizer step (it moved the trainer's logprobs by up to {moved:.3g}), weight sync, "
            f"fresh samples: engine/trainer logprob gap max {gap} (must be < {MISMATCH_TOLERANCE:g}): "
            f"{'ok' if synced_ok else 'FAILED'}{note}")
    finally:
        engine.close()
    return plain_ok and synced_ok
