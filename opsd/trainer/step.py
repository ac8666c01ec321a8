"""One optimizer step of self-distillation: score, loss, backward, clip, step."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from opsd.config import LossConfig
from opsd.loss import generalized_jsd, tinker_loss, token_logprobs
from opsd.scoring import completion_logits
from opsd.sequences import Example, collate
from opsd.trainer.distributed import Ranks
from opsd.trainer.fsdp import full_value, set_gradient_sync


def autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def distillation_losses(student_logits, teacher_logits, sampled_ids, engine_logprobs, cfg: LossConfig):
    """Per-token distillation term [N] for the configured loss kind."""
    if cfg.kind == "tinker":
        return tinker_loss(
            student_logits, teacher_logits, sampled_ids,
            temperature=cfg.temperature, sampler_logprobs=engine_logprobs,
        )
    return generalized_jsd(
        student_logits, teacher_logits, beta=cfg.beta, temperature=cfg.temperature,
        top_k=cfg.top_k, token_clip=cfg.token_clip, clip_mode=cfg.clip_mode, chunk_size=cfg.chunk_size,
    )


@dataclass
class ScoredBatch:
    """Both roles' scores of one micro-batch, on its completion tokens in row-major order."""

    sampled_ids: torch.Tensor  # [N] the completion tokens
    engine_logprobs: torch.Tensor  # [N] the sampler's logprob of each
    student_logits: torch.Tensor  # [N, V], with grad when the caller enabled it
    teacher_logits: torch.Tensor  # [N, V], no grad
    distill: torch.Tensor  # [N] per-token distillation term of the loss
    student_logprobs: torch.Tensor  # [N] the student's logprob of each sampled token


def score_micro_batch(
    student: torch.nn.Module, teacher: torch.nn.Module, micro: list[Example], *,
    loss_cfg: LossConfig, dtype: str, pad_id: int,
) -> ScoredBatch:
    """Student forward (with grad when enabled), teacher forward without, per-token terms."""
    device = next(student.parameters()).device
    completions = [e.completion_ids for e in micro]
    student_batch = collate([e.student for e in micro], completions, pad_id)
    teacher_batch = collate([e.teacher for e in micro], completions, pad_id)
    sampled = student_batch.completion_ids.to(device)
    engine_logprobs = torch.tensor([lp for e in micro for lp in e.engine_logprobs], device=device)

    with autocast(device, dtype):
        student_logits = completion_logits(student, student_batch)
        with torch.no_grad():
            teacher_logits = completion_logits(teacher, teacher_batch)
    distill = distillation_losses(student_logits, teacher_logits, sampled, engine_logprobs, loss_cfg)
    with torch.set_grad_enabled(loss_cfg.ce_weight > 0 and torch.is_grad_enabled()):
        student_logprobs = token_logprobs(student_logits, sampled)
    return ScoredBatch(sampled, engine_logprobs, student_logits, teacher_logits, distill, student_logprobs)


def train_step(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    examples: list[Example],
    optimizer: torch.optim.Optimizer,
    *,
    loss_cfg: LossConfig,
    micro_batch_size: int,
    max_grad_norm: float,
    dtype: str,
    pad_id: int,
    on_scored: Callable[[list[Example], ScoredBatch], None] | None = None,
    ranks: Ranks = Ranks(),
    total_tokens: int | None = None,
    padding: Example | None = None,
) -> dict:
    """Accumulate gradients over micro-batches of `examples`, then take one optimizer step.

    The loss is the sum of per-token losses over the whole step divided by the step's completion
    tokens, so every token weighs the same whatever micro-batch it lands in (a mean of per-batch
    means would overweight short completions). `on_scored(micro, scored)`, when given, sees each
    micro-batch's scores after its backward (the rollout dumps record per-token values there).

    Under torchrun, `total_tokens` counts the completion tokens of all ranks (global token
    normalisation) and the returned metrics are global. Every rank runs as many micro-steps as the
    busiest one, filling up with the `padding` example at loss weight 0, so that all ranks join the
    same FSDP collectives whatever they sampled; gradients are reduced on the last micro-step only.
    """
    if total_tokens is None:
        total_tokens = sum(len(e.completion_ids) for e in examples)
    micro_batches = [examples[start : start + micro_batch_size] for start in range(0, len(examples), micro_batch_size)]
    num_micro = int(ranks.max([len(micro_batches)])[0])
    if len(micro_batches) < num_micro and padding is None:
        raise ValueError("this rank has fewer micro-batches than another one and no padding example")
    micro_batches += [[padding]] * (num_micro - len(micro_batches))
    sums = {"distill": 0.0, "ce": 0.0, "mismatch": 0.0}
    mismatch_max = 0.0
    student.train()
    for index, micro in enumerate(micro_batches):
        is_padding = micro[0] is padding
        set_gradient_sync(student, index == num_micro - 1)
        scored = score_micro_batch(student, teacher, micro, loss_cfg=loss_cfg, dtype=dtype, pad_id=pad_id)
        distill, ce = scored.distill, -scored.student_logprobs
        loss = (loss_cfg.jsd_weight * distill + loss_cfg.ce_weight * ce).sum() / total_tokens
        if is_padding:
            loss = loss * 0.0  # joins the other ranks' collectives, adds nothing
        loss.backward()
        if not is_padding:
            if on_scored is not None:
                on_scored(micro, scored)
            # Same weights on both sides: a gap here means the engine did not get the last update.
            mismatch = (scored.student_logprobs.detach() - scored.engine_logprobs).abs()
            sums["distill"] += distill.detach().sum().item()
            sums["ce"] += ce.detach().sum().item()
            sums["mismatch"] += mismatch.sum().item()
            mismatch_max = max(mismatch_max, mismatch.max().item())
        del scored, loss

    params = [p for p in student.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    distill_sum, ce_sum, mismatch_sum, num_examples = ranks.sum(
        [sums["distill"], sums["ce"], sums["mismatch"], len(examples)]
    )
    jsd, ce = distill_sum / total_tokens, ce_sum / total_tokens
    metrics = {
        "loss": loss_cfg.jsd_weight * jsd + loss_cfg.ce_weight * ce,
        "jsd": jsd,
        "ce": ce,
        "grad_norm": full_value(grad_norm).item(),
        "completion_tokens": total_tokens,
        "completion_len": total_tokens / num_examples,
        "logprob_mismatch_max": ranks.max([mismatch_max])[0],
        "logprob_mismatch_mean": mismatch_sum / total_tokens,
    }
    if ranks.enabled:
        metrics["logprob_mismatch_max_per_rank"] = ranks.gather(mismatch_max)
    return metrics
