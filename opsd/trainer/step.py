"""One optimizer step of self-distillation: score and backward each micro-batch, clip, step, metrics.

`TrainStep` is built once per run from the models, the optimizer and what the config says about
scoring (`Scoring`: the loss object, dtype, pad id, micro-batch size, packing); each optimizer step
calls it with that step's examples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from opsd.loss import GuardrailSums, host_floats
from opsd.loss_kinds import Loss, weighted_loss
from opsd.scoring import ScoredBatch, Scoring, Timed, untimed
from opsd.sequences import Example
from opsd.trainer.distributed import Ranks
from opsd.trainer.fsdp import full_value, set_gradient_sync


class NonFiniteStepsError(RuntimeError):
    """`train.max_bad_steps` steps in a row had a non-finite loss or gradient norm; none was applied."""


@dataclass
class StepSums:
    """This rank's sums over a step's completion tokens, reduced over ranks for the metrics. They
    stay on the device (0-d tensors) until `step_metrics` takes them all in one transfer."""

    distill: float | torch.Tensor = 0.0
    ce: float | torch.Tensor = 0.0
    mismatch: float | torch.Tensor = 0.0
    mismatch_max: float | torch.Tensor = 0.0
    guardrails: GuardrailSums = field(default_factory=GuardrailSums)
    finite: bool = True
    """Whether the step's loss and gradient norm were finite on every rank (set by `optimizer_step`);
    a step that was not is not applied."""

    def add(self, scored: ScoredBatch) -> None:
        # Same weights on both sides: a gap here means the engine did not get the last update.
        mismatch = (scored.student_logprobs.detach() - scored.engine_logprobs).abs()
        self.distill += scored.distill.detach().sum().double()
        self.ce -= scored.student_logprobs.detach().sum().double()
        # NaN: no sampler produced these tokens (loss.kind=sft); such a micro-batch adds no mismatch.
        sampled = ~mismatch.isnan().any()
        self.mismatch += torch.where(sampled, mismatch.sum(), 0.0).double()
        batch_max = torch.where(sampled, mismatch.max(), 0.0)
        self.mismatch_max = torch.maximum(self.mismatch_max, batch_max) if torch.is_tensor(self.mismatch_max) else batch_max.clamp(min=self.mismatch_max)
        self.guardrails.add(scored.guardrails)


OnScored = Callable[[list[Example], ScoredBatch], None]


@dataclass
class TrainStep:
    """One optimizer step over a step's examples; built once per run, called once per step."""

    student: torch.nn.Module
    teacher: Any
    """What scores the teacher prompts (`opsd.teacher.Teacher.scorer`)."""
    optimizer: torch.optim.Optimizer
    scoring: Scoring
    max_grad_norm: float = 0.0
    """Clip the gradient's global norm to this; 0 = no clipping (the norm is still measured)."""
    ranks: Ranks = field(default_factory=Ranks)

    def __call__(self, examples: list[Example], total_tokens: int | None = None, padding: Example | None = None,
                 on_scored: OnScored | None = None, timed: Timed = untimed) -> dict:
        """Accumulate gradients over micro-batches of `examples`, then take one optimizer step.

        The loss is the sum of per-token losses over the whole step divided by the step's completion
        tokens, so every token weighs the same whatever micro-batch it lands in (a mean of per-batch
        means would overweight short completions). `on_scored(micro, scored)`, when given, sees each
        micro-batch's scores after its backward (the rollout dumps record per-token values there).

        Under torchrun, `total_tokens` counts the completion tokens of all ranks (global token
        normalisation) and the returned metrics are global; `padding` fills up the micro-batches of a
        rank that has fewer than the busiest one (see `micro_batches`). `timed(part)` times each part
        of the step (`StageTimer.part`: the run logs them as `time_train/<part>_s`).
        """
        loss = self.scoring.loss
        if total_tokens is None:
            total_tokens = sum(len(e.completion_ids) for e in examples)
        batches = micro_batches(examples, self.scoring.micro_batch_size, self.ranks, padding)
        self.student.train()
        sums = StepSums()
        for index, micro in enumerate(batches):
            set_gradient_sync(self.student, index == len(batches) - 1)  # HSDP: all-reduce replicas once, at the end
            scored = self.scoring.micro_batch(self.student, self.teacher, micro, timed)
            is_padding = micro[0] is padding
            with timed("backward"):
                backward(scored, loss, total_tokens, weight=0.0 if is_padding else 1.0)
            if not is_padding:
                with timed("metrics"):
                    sums.add(scored)
                if on_scored is not None:
                    with timed("rollout_dumps"):
                        on_scored(micro, scored)
            with timed("free"):  # the micro-batch's [N, V] logits go back to the allocator
                del scored
        grad_norm = optimizer_step(self.student, self.optimizer, self.max_grad_norm, timed, sums, self.ranks)
        with timed("metrics_reduce"):
            metrics = step_metrics(sums, grad_norm, loss, self.ranks, total_tokens, num_examples=len(examples))
        if not sums.finite:
            metrics["nonfinite_step"] = 1
        return metrics


def micro_batches(examples: list[Example], size: int, ranks: Ranks, padding: Example | None) -> list[list[Example]]:
    """`examples` in micro-batches of `size`. Every rank runs as many as the busiest one, filling up
    with the `padding` example (trained at loss weight 0), so that all ranks join the same FSDP
    collectives whatever they sampled."""
    batches = [examples[start : start + size] for start in range(0, len(examples), size)]
    count = int(ranks.max([len(batches)])[0])
    if len(batches) < count and padding is None:
        raise ValueError("this rank has fewer micro-batches than another one and no padding example")
    return batches + [[padding]] * (count - len(batches))


def backward(scored: ScoredBatch, loss: Loss, total_tokens: int, weight: float = 1.0) -> None:
    """Backward of this micro-batch's share of the step loss (sum over its tokens / the step's tokens)."""
    share = scored.token_losses(loss).sum() / total_tokens
    (share * weight).backward()  # weight 0 (padding) joins the other ranks' collectives, adds nothing


def optimizer_step(student: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                   timed: Timed = untimed, sums: StepSums | None = None, ranks: Ranks | None = None) -> torch.Tensor:
    """Clip the accumulated gradients (0 = no clip, norm still measured), step, zero; the norm.

    A step whose gradient norm or loss sums (`sums`) are not finite on some rank is not applied:
    the gradients are dropped, the weights and the optimizer's moments stay as they were, and
    `sums.finite` says so (all ranks agree, with one all-reduce). Clipping a NaN norm would only
    spread the NaN into every weight."""
    with timed("clip"):
        params = [p for p in student.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    finite = True
    if sums is not None:
        norm = full_value(grad_norm)
        checked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=norm.device).reshape(())
                               for v in (norm, sums.distill, sums.ce)])
        finite = bool(torch.isfinite(checked).all())  # one transfer to the host per step
        if ranks is not None and ranks.enabled:
            finite = ranks.max([0.0 if finite else 1.0])[0] == 0
        sums.finite = finite
    with timed("optimizer"):
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def step_metrics(sums: StepSums, grad_norm, loss: Loss, ranks: Ranks, total_tokens: int, *, num_examples: int) -> dict:
    """The step's metrics over all ranks (collectives: every rank calls this): the loss, its kind's
    distillation metric (none for `sft`), CE, and the guardrails that apply to the kind."""
    # This rank's values leave the device here, once per step.
    distill, ce, mismatch, mismatch_max, grad_norm, *guardrails = host_floats(
        [sums.distill, sums.ce, sums.mismatch, sums.mismatch_max, full_value(grad_norm), *sums.guardrails.as_list()]
    )
    distill_sum, ce_sum, mismatch_sum, num_examples, *guardrails = ranks.sum([distill, ce, mismatch, num_examples, *guardrails])
    distill, ce = distill_sum / total_tokens, ce_sum / total_tokens
    metrics = {"loss": weighted_loss(loss, distill, ce), **({loss.metric: distill} if loss.metric else {}), "ce": ce}
    metrics.update({
        "grad_norm": grad_norm,
        "completion_tokens": total_tokens,
        "completion_len": total_tokens / num_examples,
        "logprob_mismatch_max": ranks.max([mismatch_max])[0],
        "logprob_mismatch_mean": mismatch_sum / total_tokens,
    })
    guardrail_metrics = GuardrailSums(*guardrails).metrics()
    metrics.update({name: guardrail_metrics[name] for name in loss.guardrail_names})
    if ranks.enabled:
        metrics["logprob_mismatch_max_per_rank"] = ranks.gather(mismatch_max)
    return metrics
