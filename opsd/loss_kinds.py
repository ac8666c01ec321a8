"""The loss kinds (`loss.kind`): one small object per kind, built once from its config section.

A kind says whether its completions are sampled from the student (`on_policy`) and whether it
scores with a teacher (`needs_teacher`); it turns both roles' completion logits into its per-token
distillation term (`distill`, the tensor math is opsd/loss.py), gives the weights of that term and
of cross-entropy, names its metric and the guardrail metrics that mean something for it, and
describes itself for the plan line. A kind may add a reward term (`reward_weight`, `reward_term`:
the GRPO policy gradient on the step's group-relative advantages; `grpo` is that term alone).
Scoring and the step take the object and never ask for the kind. A new kind: its section in opsd/config.py (a member of `LossConfig`), a class here, a line
in `LOSSES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from opsd.config import GrpoLossConfig, JsdLossConfig, LossConfig, SftLossConfig, TinkerLossConfig
from opsd.loss import LOGPROB_CHUNK_ROWS, GuardrailSums, generalized_jsd, grpo_loss, tinker_loss

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
    teacher_sees_privilege: ClassVar[bool]
    """True: the teacher scores the teacher prompt; False: the student's prompt (`grpo`'s reference model)."""
    guardrail_names: ClassVar[tuple[str, ...]]
    """The keys of `GuardrailSums.metrics()` the step logs for this kind."""

    @property
    def weights(self) -> tuple[float, float]:
        """(weight of `distill`, weight of cross-entropy) in the loss."""

    @property
    def chunk_rows(self) -> int:
        """Completion tokens the loss processes at once (its float32 [rows, vocabulary] memory)."""

    @property
    def reward_weight(self) -> float:
        """Weight of `reward_term` in the loss; 0: no reward term (none is computed)."""

    @property
    def needs_advantages(self) -> bool:
        """Whether `distill` or `reward_term` reads the completions' advantages."""

    def distill(self, student_logits: Tensor, teacher_logits: Tensor, sampled_ids: Tensor,
                sampler_logprobs: Tensor, guardrails: GuardrailSums | None = None,
                advantages: Tensor | None = None) -> Tensor:
        """[N] per-token distillation term from [N, V] logits of both roles (`advantages`: [N], each
        token's completion's, when `needs_advantages`). With `guardrails`, the kind adds the guardrail
        sums its own computation yields (scoring adds the student's entropy)."""

    def reward_term(self, student_logits: Tensor, sampled_ids: Tensor, sampler_logprobs: Tensor,
                    advantages: Tensor) -> Tensor:
        """[N] per-token GRPO term added with `reward_weight` (only called when that is > 0)."""

    def describe(self) -> str:
        """The settings this kind uses, for the plan line."""


def weighted_loss(loss: Loss, distill, ce, reward=None):
    """The loss from its parts (per token, or summed): the one place the formula is written,
    distill_weight * distill + ce_weight * ce + reward_weight * reward."""
    distill_weight, ce_weight = loss.weights
    total = distill_weight * distill + ce_weight * ce
    if loss.reward_weight:  # 0: no reward term at all, the loss bit for bit as without one
        total = total + loss.reward_weight * reward
    return total


def added_reward_term(loss: "JsdLoss | TinkerLoss", student_logits, sampled_ids, sampler_logprobs, advantages) -> Tensor:
    """`reward_term` of the distillation kinds (the GRPO term they add with `loss.reward_weight`):
    `grpo_loss` at their `clip_eps`."""
    return grpo_loss(student_logits, sampled_ids, advantages, sampler_logprobs, clip_eps=loss.cfg.clip_eps)


def describe_added_reward(cfg: JsdLossConfig | TinkerLossConfig) -> str:
    return f" + grpo x{cfg.reward_weight} (clip_eps={cfg.clip_eps})" if cfg.reward_weight else ""


@dataclass(frozen=True)
class JsdLoss:
    """The OPSD reference: the generalized JSD over the teacher's top-k tokens, clipped."""

    cfg: JsdLossConfig
    metric: ClassVar[str | None] = "jsd"
    can_be_negative: ClassVar[bool] = False
    on_policy: ClassVar[bool] = True
    needs_teacher: ClassVar[bool] = True
    guardrail_names: ClassVar[tuple[str, ...]] = ("teacher_topk_mass", "clip_fraction", "student_entropy")
    teacher_sees_privilege: ClassVar[bool] = True
    reward_weight = property(lambda self: self.cfg.reward_weight)
    needs_advantages = property(lambda self: self.cfg.reward_weight > 0)
    reward_term = added_reward_term

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

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None,
                advantages=None) -> Tensor:
        return generalized_jsd(student_logits, teacher_logits, **self._settings(), guardrails=guardrails)

    def describe(self) -> str:
        c = self.cfg
        return (f"jsd x{c.jsd_weight} + ce x{c.ce_weight}{describe_added_reward(c)}, beta={c.beta}, T={c.temperature}, "
                f"top_k={c.top_k}, clip={c.token_clip} ({c.clip_mode})")


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
    teacher_sees_privilege: ClassVar[bool] = True
    reward_weight = property(lambda self: self.cfg.reward_weight)
    needs_advantages = property(lambda self: self.cfg.reward_weight > 0)
    reward_term = added_reward_term

    @property
    def weights(self) -> tuple[float, float]:
        return self.cfg.tinker_weight, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return LOGPROB_CHUNK_ROWS

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None,
                advantages=None) -> Tensor:
        return tinker_loss(student_logits, teacher_logits, sampled_ids, temperature=self.cfg.temperature,
                           sampler_logprobs=sampler_logprobs)

    def describe(self) -> str:
        c = self.cfg
        return f"tinker x{c.tinker_weight} + ce x{c.ce_weight}{describe_added_reward(c)}, T={c.temperature}"


@dataclass(frozen=True)
class SftLoss:
    """The supervised baseline: cross-entropy on the privileged text, no teacher, no distillation."""

    cfg: SftLossConfig
    metric: ClassVar[str | None] = None
    can_be_negative: ClassVar[bool] = False
    on_policy: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    teacher_sees_privilege: ClassVar[bool] = True
    reward_weight: ClassVar[float] = 0.0
    needs_advantages: ClassVar[bool] = False
    guardrail_names: ClassVar[tuple[str, ...]] = ENTROPY_ONLY

    @property
    def weights(self) -> tuple[float, float]:
        return 0.0, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return LOGPROB_CHUNK_ROWS  # the cross-entropy's `token_logprobs`

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None,
                advantages=None) -> Tensor:
        return torch.zeros(len(sampled_ids), device=student_logits.device)

    def describe(self) -> str:
        return f"ce x{self.cfg.ce_weight} on the privileged text (no sampling, no teacher)"


@dataclass(frozen=True)
class GrpoLoss:
    """GRPO: the PPO-clipped policy gradient on group-relative reward advantages, token level, no
    teacher; with `kl_weight`, a KL penalty to the initial weights (the frozen teacher copy scoring
    the student's prompt)."""

    cfg: GrpoLossConfig
    metric: ClassVar[str | None] = "grpo_loss"
    can_be_negative: ClassVar[bool] = True
    on_policy: ClassVar[bool] = True
    teacher_sees_privilege: ClassVar[bool] = False
    reward_weight: ClassVar[float] = 0.0  # the GRPO term is this kind's `distill`
    needs_advantages: ClassVar[bool] = True
    guardrail_names: ClassVar[tuple[str, ...]] = ENTROPY_ONLY

    @property
    def needs_teacher(self) -> bool:
        return self.cfg.kl_weight > 0

    @property
    def weights(self) -> tuple[float, float]:
        return 1.0, self.cfg.ce_weight

    @property
    def chunk_rows(self) -> int:
        return LOGPROB_CHUNK_ROWS

    def distill(self, student_logits, teacher_logits, sampled_ids, sampler_logprobs, guardrails=None,
                advantages=None) -> Tensor:
        c = self.cfg
        return grpo_loss(student_logits, sampled_ids, advantages, sampler_logprobs, clip_eps=c.clip_eps,
                         reference_logits=teacher_logits if c.kl_weight > 0 else None, kl_weight=c.kl_weight)

    def describe(self) -> str:
        c = self.cfg
        kl = f" + kl x{c.kl_weight} to the initial weights" if c.kl_weight else ""
        return f"grpo (clip_eps={c.clip_eps}){kl} + ce x{c.ce_weight}, no teacher"


LOSSES = {JsdLossConfig: JsdLoss, TinkerLossConfig: TinkerLoss, SftLossConfig: SftLoss, GrpoLossConfig: GrpoLoss}
"""Config section -> loss kind."""

DISTILL_METRICS = {cls.metric: cls.can_be_negative for cls in LOSSES.values() if cls.metric}
"""The distillation metrics any kind logs -> whether it can be negative."""


def build_loss(cfg: LossConfig) -> Loss:
    """The loss object of a `loss` section, built once per run."""
    return LOSSES[type(cfg)](cfg)
