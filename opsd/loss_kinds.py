"""The loss kinds (`loss.kind`): one small object per kind, built once from its config section.

A kind says whether its completions are sampled from the student (`on_policy`) and whether it
scores with a teacher (`needs_teacher`); it turns both roles' completion logits into its per-token
distillation term (`distill`, the tensor math is opsd/loss.py), gives the weights of that term and
of cross-entropy, names its metric and the guardrail metrics that mean something for it, and
describes itself for the plan line. Scoring and the step take the object and never ask for the
kind. A new kind: its section in opsd/config.py (a member of `LossConfig`), a class here, a line
in `LOSSES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from opsd.config import JsdLossConfig, LossConfig, SftLossConfig, TinkerLossConfig
from opsd.loss import LOGPROB_CHUNK_ROWS, GuardrailSums, generalized_jsd, tinker_loss

ENTROPY_ONLY = ("student_entropy",)


class Loss(Protocol):
    """What a loss kind offers the trainer (implemented by the classes below)."""

    metric: ClassVar[str | None]
    """The logged name of the step's per-token mean of `distill`; None: the kind has no such term."""
    can_be_negative: ClassVar[bool]
    """Whether that metric can go below 0 (then a relative change of it says nothing)."""
    on_policy: ClassVar[bool]
    """True: completions are sampled from the student; False: they are the privileged texts."""
    needs_teacher: ClassVar[bool]
    """False: no teacher forward (its scores are the student's)."""
    guardrail_names: ClassVar[tuple[str, ...]]
    """The keys of `GuardrailSums.metrics()` the step logs for this kind."""

    @property
    def weights(self) -> tuple[float, float]:
        """(weight of `distill`, weight of cross-entropy) in the loss."""

    @property
    def chunk_rows(self) -> int:
        """Completion tokens the loss processes at once (its float32 [rows, vocabulary] memory)."""

    def distill(self, student_logits: Tensor, teacher_logits: Tensor, sampled_ids: Tensor,
                sampler_logprobs: Tensor, guardrails: GuardrailSums | None = None) -> Tensor:
        """[N] per-token distillation term from [N, V] logits of both roles. With `guardrails`, the
        kind adds the guardrail sums its own computation yields (scoring adds the student's entropy)."""

    def describe(self) -> str:
        """The settings this kind uses, for the plan line."""


def weighted_loss(loss: Loss, distill, ce):
    """The loss from its two parts (per token, or summed): the one place the formula is written."""
    distill_weight, ce_weight = loss.weights
    return distill_weight * distill + ce_weight * ce


@dataclass(frozen=True)
class JsdLoss:
    """The OPSD reference: the generalized JSD over the teacher's top-k tokens, clipped."""

    cfg: JsdLossConfig
    metric: ClassVar[str | None] = "jsd"
    can_be_negative: ClassVar[bool] = False
    on_policy: ClassVar[bool] = True
    needs_teacher: ClassVar[bool] = True
    guardrail_names: ClassVar[tuple[str, ...]] = ("teacher_topk_mass", "clip_fraction", "student_entropy")

    @property
    def weights(self) -> tuple[float, float]:
        return self.cfg.jsd_weight, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return self.cfg.chunk_size

    def _settings(self) -> dict:
        c = self.cfg
        return dict(beta=c.beta, temperature=c.temperature, top_k=c.top_k, token_clip=c.token_clip,
                    clip_mode=c.clip_mode, chunk_size=c.chunk_size)

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None) -> Tensor:
        return generalized_jsd(student_logits, teacher_logits, **self._settings(), guardrails=guardrails)

    def describe(self) -> str:
        c = self.cfg
        return (f"jsd x{c.jsd_weight} + ce x{c.ce_weight}, beta={c.beta}, T={c.temperature}, top_k={c.top_k}, "
                f"clip={c.token_clip} ({c.clip_mode})")


@dataclass(frozen=True)
class TinkerLoss:
    """Thinking Machines' on-policy distillation: a policy gradient on the sampled token, the reverse
    KL as advantage, importance-weighted against the sampler's logprob. No top-k, no clip."""

    cfg: TinkerLossConfig
    metric: ClassVar[str | None] = "tinker_loss"
    can_be_negative: ClassVar[bool] = True
    on_policy: ClassVar[bool] = True
    needs_teacher: ClassVar[bool] = True
    guardrail_names: ClassVar[tuple[str, ...]] = ENTROPY_ONLY

    @property
    def weights(self) -> tuple[float, float]:
        return self.cfg.tinker_weight, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return LOGPROB_CHUNK_ROWS

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None) -> Tensor:
        return tinker_loss(student_logits, teacher_logits, sampled_ids, temperature=self.cfg.temperature,
                           sampler_logprobs=sampler_logprobs)

    def describe(self) -> str:
        c = self.cfg
        return f"tinker x{c.tinker_weight} + ce x{c.ce_weight}, T={c.temperature}"


@dataclass(frozen=True)
class SftLoss:
    """The supervised baseline: cross-entropy on the privileged text, no teacher, no distillation."""

    cfg: SftLossConfig
    metric: ClassVar[str | None] = None
    can_be_negative: ClassVar[bool] = False
    on_policy: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    guardrail_names: ClassVar[tuple[str, ...]] = ENTROPY_ONLY

    @property
    def weights(self) -> tuple[float, float]:
        return 0.0, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return LOGPROB_CHUNK_ROWS  # the cross-entropy's `token_logprobs`

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None) -> Tensor:
        return torch.zeros(len(sampled_ids), device=student_logits.device)

    def describe(self) -> str:
        return f"ce x{self.cfg.ce_weight} on the privileged text (no sampling, no teacher)"


LOSSES = {JsdLossConfig: JsdLoss, TinkerLossConfig: TinkerLoss, SftLossConfig: SftLoss}
"""Config section -> loss kind."""

DISTILL_METRICS = {cls.metric: cls.can_be_negative for cls in LOSSES.values() if cls.metric}
"""The distillation metrics any kind logs -> whether it can be negative."""


def build_loss(cfg: LossConfig) -> Loss:
    """The loss object of a `loss` section, built once per run."""
    return LOSSES[type(cfg)](cfg)
