"""Per-token distillation losses on completion positions.

`generalized_jsd` is the OPSD reference loss, step for step as the Visual-OPSD reference code
computes it: top-k on the teacher, temperature, beta-mixture divergence (TRL convention),
elementwise clip, sum over the vocabulary, times T^2. `tinker_loss` is Thinking Machines' on-policy distillation: a policy gradient on the
sampled token with the per-token reverse KL as (negative) advantage. `grpo_loss` is the PPO-clipped
policy gradient on group-relative reward advantages (`group_advantages`), no teacher.

Both return an unreduced float32 [N] tensor (float64 for float64 inputs): the trainer divides the
sum over an optimizer step by that step's number of completion tokens, so per-micro-batch means
would weigh tokens wrongly. The teacher is always detached. Rows are processed in chunks so that
memory beyond the inputs and their gradient does not grow with N x V.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "GuardrailSums", "generalized_jsd", "group_advantages", "grpo_loss", "guardrail_sums", "host_floats",
    "logprobs_and_entropy", "tinker_loss", "token_logprobs",
]

LOGPROB_CHUNK_ROWS = 1024
"""Rows `token_logprobs` (and so `tinker_loss`) processes at once."""
SCRATCH_BYTES = 16 << 20
"""Largest float32 temporary of a full-vocabulary pass on the CPU (`scratch_rows`)."""


def _upcast(x: Tensor) -> Tensor:
    """At least float32 (float64 stays float64, which gradcheck relies on)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_logits(student_logits: Tensor, teacher_logits: Tensor) -> None:
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits must be 2-D [N, V], got shape {tuple(student_logits.shape)}")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher_logits.shape)} != student_logits shape "
            f"{tuple(student_logits.shape)}"
        )


def _by_rows(fn, chunk_size: int, use_checkpoint: bool, *tensors: Tensor) -> Tensor:
    """Concatenate fn over row chunks; with use_checkpoint, backward recomputes one chunk at a time
    instead of autograd holding every chunk's float32 [chunk, V] intermediates."""
    outs = []
    for parts in zip(*(t.split(chunk_size) for t in tensors)):
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if use_checkpoint else fn(*parts))
    return torch.cat(outs)


def _divergence_terms(s: Tensor, t: Tensor, beta: float, temperature: float) -> Tensor:
    """Per-entry divergence terms [n, k] of logit rows [n, k] (k = the kept vocabulary entries)."""
    log_s = F.log_softmax(_upcast(s) / temperature, dim=-1)
    log_t = F.log_softmax(_upcast(t) / temperature, dim=-1)
    if beta == 0:  # forward KL(teacher || student); the mixture form would take log(0)
        return log_t.exp() * (log_t - log_s)
    if beta == 1:  # reverse KL(student || teacher)
        return log_s.exp() * (log_s - log_t)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
    return beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)


def _divergence(
    s: Tensor, t: Tensor, beta: float, temperature: float, token_clip: float, clip_mode: str
) -> tuple[Tensor, Tensor]:
    """Per-token divergence of logit rows [n, k] (k = the kept vocabulary entries), and how many
    entries (`entry` clip) or tokens (`token` clip) the clip cut, for the guardrail metrics."""
    terms = _divergence_terms(s, t, beta, temperature)
    clipped = torch.zeros((), dtype=torch.long, device=s.device)
    if token_clip > 0 and clip_mode == "entry":
        clipped = (terms > token_clip).sum()
        terms = terms.clamp(max=token_clip)
    loss = terms.sum(dim=-1)
    if token_clip > 0 and clip_mode == "token":
        clipped = (loss > token_clip).sum()
        loss = loss.clamp(max=token_clip)
    # A row the teacher scores exactly as the student (the same weights reading the same prompt)
    # has divergence 0 and gradient 0. Autograd's gradient there is round-off instead (log_softmax's
    # backward leaves p * (sum(q) - 1), about 1e-7 p), and Adam, which scales each weight's step by
    # that weight's own gradient size, turns round-off into steps of the full learning rate.
    loss = torch.where((s == t).all(dim=-1), 0.0, loss)
    return loss * temperature**2, clipped


def scratch_rows(chunk_size: int, logits: Tensor) -> int:
    """Rows of `logits` a full-vocabulary float32 pass takes at once: `chunk_size`, and on the CPU
    at most 16 MiB per temporary. glibc serves larger blocks from fresh mmaps that fault in every
    page at each use: an [N, V] pass in rows of 16 MiB measured 2 to 3x faster than in one piece."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] == 0:
        return chunk_size
    return max(1, min(chunk_size, SCRATCH_BYTES // (4 * logits.shape[-1])))


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / T, at least float32 (no copy at T = 1 for float32 logits: the division is exact)."""
    return _upcast(logits) if temperature == 1 else _upcast(logits) / temperature


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 0,
    token_clip: float = 0.0,
    clip_mode: str = "entry",
    chunk_size: int = 1024,
    guardrails: "GuardrailSums | None" = None,
) -> Tensor:
    """Per-token generalized JSD [N] between student and teacher logits [N, V].

    beta weighs the teacher in the mixture M = (1 - beta) p_S + beta p_T; beta = 0 is forward
    KL(teacher || student), beta = 1 reverse KL(student || teacher). top_k > 0 keeps the teacher's
    top-k entries per position (both sides renormalised over them). token_clip > 0 caps each
    per-entry term ("entry", the reference) or the per-token sum ("token").

    With `guardrails`, what the loss leaves out or cuts is added to it from the loss's own
    intermediates (the teacher's top-k and the per-entry terms are not computed again): the
    teacher's probability mass inside its top-k (one more pass, over the teacher's logits) and the
    clipped entries or tokens. Tensors, so that no value leaves the device here.
    """
    _check_logits(student_logits, teacher_logits)
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not token_clip >= 0:
        raise ValueError(f"token_clip must be >= 0, got {token_clip}")
    if clip_mode not in ("entry", "token"):
        raise ValueError(f"clip_mode must be 'entry' or 'token', got {clip_mode!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    teacher_logits = teacher_logits.detach()
    full_teacher = teacher_logits
    args = (beta, temperature, token_clip, clip_mode)

    truncated = 0 < top_k < student_logits.shape[-1]
    if truncated:
        # topk and gather on the original dtype, so only [N, k] slices are ever upcast. The gather
        # is one `take` on flat indices over all rows: its backward writes a single [N, V] gradient
        # (gather's backward, a scatter, measured 3x the gradient's memory for bf16 on CPU).
        tops = [t.topk(top_k, dim=-1) for t in teacher_logits.split(chunk_size)]
        teacher_logits = torch.cat([values for values, _ in tops])
        n, v = student_logits.shape
        rows = torch.arange(n, device=student_logits.device).unsqueeze(-1)
        student_logits = student_logits.take(torch.cat([idx for _, idx in tops]) + rows * v)

    needs_grad = torch.is_grad_enabled() and student_logits.requires_grad
    fn = lambda s, t: _divergence(s, t, *args)  # noqa: E731
    losses, clipped = [], []
    for s, t in zip(student_logits.split(chunk_size), teacher_logits.split(chunk_size)):
        # With grad, backward recomputes one chunk at a time instead of autograd holding every
        # chunk's float32 [chunk, k] intermediates.
        loss, count = checkpoint(fn, s, t, use_reentrant=False) if needs_grad else fn(s, t)
        losses.append(loss)
        clipped.append(count)
    out = torch.cat(losses)
    if guardrails is not None:
        n = student_logits.shape[0]
        with torch.no_grad():
            guardrails.teacher_topk_mass += _kept_mass(full_teacher, teacher_logits, temperature, chunk_size) if truncated else float(n)
            if token_clip > 0:
                guardrails.clipped += torch.stack(clipped).sum().double()
                guardrails.clip_candidates += float(n * (teacher_logits.shape[-1] if clip_mode == "entry" else 1))
    return out


def _kept_mass(full: Tensor, top_values: Tensor, temperature: float, chunk_size: int) -> Tensor:
    """Sum over rows of the probability (softmax of full / T) of the entries whose logits are `top_values`."""
    rows = scratch_rows(chunk_size, full)
    log_z = torch.cat([torch.logsumexp(_scaled(t, temperature), dim=-1) for t in full.split(rows)])
    return (torch.logsumexp(_scaled(top_values, temperature), dim=-1) - log_z).exp().sum().double()


def _sampled_logprob(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / T)[y] per row, without keeping a log-softmaxed [n, V] copy."""
    scaled = _upcast(logits) / temperature
    return scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def token_logprobs(logits: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk_size: int = LOGPROB_CHUNK_ROWS) -> Tensor:
    """log p(ids[i]) under softmax(logits[i] / T), [N] float32; chunked like the losses.

    The trainer uses it for CE on the sampled tokens and for the engine-vs-trainer logprob check.
    """
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    return _by_rows(lambda x, y: _sampled_logprob(x, y, temperature), chunk_size, needs_grad, logits, ids)


def tinker_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    sampled_ids: Tensor,
    *,
    temperature: float = 1.0,
    sampler_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token on-policy distillation loss [N] on the sampled tokens y.

    A = log p_T(y) - log p_S(y) at the loss temperature (detached) and loss = -A * log p_S(y).
    With sampler_logprobs (the sampling engine's raw log p(y), possibly from lagging weights) each
    token is importance weighted by ratio = exp(log p_S(y) - sampler_logprobs), both sides raw
    (temperature 1) whatever the loss temperature, so that the ratio is 1 when the sampler holds the
    student's weights; the ratio is detached: loss = -A * ratio * log p_S(y).
    """
    _check_logits(student_logits, teacher_logits)
    n = student_logits.shape[0]
    if sampled_ids.shape != (n,) or sampled_ids.dtype.is_floating_point:
        raise ValueError(
            f"sampled_ids must be an integer tensor of shape ({n},), "
            f"got {sampled_ids.dtype} {tuple(sampled_ids.shape)}"
        )
    # Checked on the CPU only: elsewhere the check would be a device sync per call, and the gather
    # below fails on an id out of range anyway.
    if n and sampled_ids.device.type == "cpu" and ((sampled_ids < 0) | (sampled_ids >= student_logits.shape[-1])).any():
        raise ValueError("sampled_ids must lie in [0, V)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if sampler_logprobs is not None and sampler_logprobs.shape != (n,):
        raise ValueError(f"sampler_logprobs must have shape ({n},), got {tuple(sampler_logprobs.shape)}")

    student_lp = token_logprobs(student_logits, sampled_ids, temperature=temperature, chunk_size=LOGPROB_CHUNK_ROWS)
    with torch.no_grad():
        teacher_lp = token_logprobs(teacher_logits, sampled_ids, temperature=temperature, chunk_size=LOGPROB_CHUNK_ROWS)
    advantage = (teacher_lp - student_lp).detach()
    if sampler_logprobs is None:
        return -advantage * student_lp
    with torch.no_grad():
        raw_lp = student_lp if temperature == 1 else token_logprobs(
            student_logits, sampled_ids, chunk_size=LOGPROB_CHUNK_ROWS
        )
        ratio = torch.exp(raw_lp - _upcast(sampler_logprobs))
    return -advantage * ratio * student_lp


def group_advantages(rewards: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO's group-relative advantages of rewards [G, n] (G prompts, n samples each): each reward minus
    its group's mean, divided by the group's standard deviation (unbiased, plus `eps`) when
    `scale_by_std`. A group whose rewards are all equal gets exactly 0 for every sample."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples >= 2], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(flat, 0.0, centred)  # exactly 0: the mean's round-off would leave ~1e-17
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def grpo_loss(
    student_logits: Tensor,
    sampled_ids: Tensor,
    advantages: Tensor,
    sampler_logprobs: Tensor,
    *,
    clip_eps: float = 0.2,
    reference_logits: Tensor | None = None,
    kl_weight: float = 0.0,
) -> Tensor:
    """Per-token PPO-clipped policy gradient [N] on the sampled tokens y (GRPO, token level).

    r = exp(log p_S(y) - sampler_logprobs) (both raw, temperature 1; r = 1 when the sampler holds the
    student's weights), A the token's completion's advantage (detached) and
    loss = -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A); with `reference_logits` and `kl_weight`,
    plus kl_weight * (exp(d) - d - 1), d = log p_ref(y) - log p_S(y) (the k3 estimator of
    KL(student || reference)). A token with A = 0 (a group whose rewards are all equal) adds exactly
    zero gradient unless the KL term is on.
    """
    n = student_logits.shape[0]
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits must be 2-D [N, V], got shape {tuple(student_logits.shape)}")
    for name, t in (("sampled_ids", sampled_ids), ("advantages", advantages), ("sampler_logprobs", sampler_logprobs)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    student_lp = token_logprobs(student_logits, sampled_ids, chunk_size=LOGPROB_CHUNK_ROWS)
    advantages = _upcast(advantages.detach()).to(student_lp.dtype)
    ratio = torch.exp(student_lp - _upcast(sampler_logprobs.detach()).to(student_lp.dtype))
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if reference_logits is not None and kl_weight > 0:
        with torch.no_grad():
            reference_lp = token_logprobs(reference_logits.detach(), sampled_ids, chunk_size=LOGPROB_CHUNK_ROWS)
        d = reference_lp - student_lp
        loss = loss + kl_weight * (torch.exp(d) - d - 1)
    return loss


@torch.no_grad()
def logprobs_and_entropy(logits: Tensor, ids: Tensor | None, *, chunk_size: int = LOGPROB_CHUNK_ROWS) -> tuple[Tensor | None, Tensor]:
    """log p(ids[i]) at temperature 1 ([N] float32; None without `ids`) and the sum of the rows'
    entropies (0-d float64), from one log-softmax per row chunk. No gradient: cross-entropy trains
    through `token_logprobs`."""
    rows = scratch_rows(chunk_size, logits)
    picked, entropy = [], torch.zeros((), dtype=torch.float64, device=logits.device)
    for i, x in enumerate(logits.detach().split(rows)):
        log_p = F.log_softmax(_upcast(x), dim=-1)
        if ids is not None:
            picked.append(log_p.gather(-1, ids[i * rows : (i + 1) * rows].unsqueeze(-1)).squeeze(-1))
        # sum_v p log p of each row as one batched dot product: no [rows, V] product is written
        entropy -= torch.bmm(log_p.exp().unsqueeze(1), log_p.unsqueeze(2)).sum().double()
    return (torch.cat(picked) if ids is not None else None), entropy


def host_floats(values: list) -> list[float]:
    """Python floats of numbers and 0-d tensors; the tensors leave the device in one transfer."""
    out = [v if isinstance(v, Tensor) else float(v) for v in values]
    at = [i for i, v in enumerate(out) if isinstance(v, Tensor)]
    if at:
        for i, value in zip(at, torch.stack([out[i].detach().double() for i in at]).tolist()):
            out[i] = value
    return out


@dataclass
class GuardrailSums:
    """Sums over a batch's completion tokens behind the per-step guardrail metrics; they add up over
    micro-batches and ranks before the division (`GuardrailSums.metrics`). While a step runs they
    are 0-d tensors (no value leaves the device per micro-batch); `host_floats` turns them to numbers."""

    tokens: float = 0.0
    teacher_topk_mass: float | Tensor = 0.0
    """Sum of the teacher's probability (at the loss temperature) inside its top-k; 1 per token at top_k 0."""
    clipped: float | Tensor = 0.0
    """Clipped entries (`entry` clip) or tokens (`token` clip)."""
    clip_candidates: float = 0.0
    """Entries or tokens the clip looked at (0 when the loss does not clip)."""
    student_entropy: float | Tensor = 0.0
    """Sum of the student's entropy (temperature 1, full vocabulary), nats."""

    def add(self, other: "GuardrailSums") -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_list(self) -> list[float | Tensor]:
        return list(vars(self).values())

    def metrics(self) -> dict[str, float]:
        """`teacher_topk_mass`, `clip_fraction`, `student_entropy`: means per token (per clip candidate)."""
        tokens, mass, clipped, candidates, entropy = host_floats(self.as_list())
        tokens = max(tokens, 1.0)
        return {
            "teacher_topk_mass": mass / tokens,
            "clip_fraction": clipped / candidates if candidates else 0.0,
            "student_entropy": entropy / tokens,
        }


@torch.no_grad()
def guardrail_sums(
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 0,
    token_clip: float = 0.0,
    clip_mode: str = "entry",
    chunk_size: int = 1024,
) -> GuardrailSums:
    """What the loss leaves out or cuts, and how spread the student is, from logits alone (numbers).

    The same computations a training step makes beside its loss (`generalized_jsd(guardrails=...)`,
    `logprobs_and_entropy`), for logits scored outside one. Without `teacher_logits` only the
    student's entropy is summed (the teacher's top-k mass counts 1 per token).
    """
    sums = GuardrailSums(tokens=float(student_logits.shape[0]))
    if teacher_logits is None:
        sums.teacher_topk_mass = sums.tokens
    else:
        generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature, top_k=top_k,
                        token_clip=token_clip, clip_mode=clip_mode, chunk_size=chunk_size, guardrails=sums)
    sums.student_entropy += logprobs_and_entropy(student_logits, None, chunk_size=chunk_size)[1]
    return GuardrailSums(*host_floats(sums.as_list()))
