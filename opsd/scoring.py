"""Score completions with both roles: logits on the completion positions, per-token terms of the loss.

`Scoring.micro_batch` is the shared core of a training step, `--check` and offline rollout dumps:
the student forward (with grad when enabled), the teacher forward without (when the loss kind has a
teacher), and on the completion tokens the per-token distillation term (`distill`), the student's
logprob of each sampled token and the guardrail sums, each full-vocabulary pass made once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import torch

from opsd.config import Config
from opsd.loss import GuardrailSums, logprobs_and_entropy, token_logprobs
from opsd.loss_kinds import Loss, build_loss, weighted_loss
from opsd.prompts import tokenizer_of
from opsd.sequences import Example, ForwardBatch, collate

SCORING_METHOD = "opsd_completion_logits"
"""A sharded (FSDP2) model scores through this method of its own, registered as an FSDP forward
method (opsd/trainer/fsdp.py) so that FSDP gathers the parameters outside the blocks around it."""


def completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """[N, V] logits predicting each completion token, in `batch.completion_ids` order.

    The LM head runs on the completion positions alone: prompts (with many image tokens) can be
    far longer than completions, and [B, L, V] logits would dominate memory.
    """
    sharded = getattr(model, SCORING_METHOD, None)
    if sharded is not None:
        return sharded(batch)
    return forward_completion_logits(model, batch)


def forward_completion_logits(model, batch: ForwardBatch) -> torch.Tensor:
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    mask = inputs["attention_mask"]
    if mask.dim() == 4 and model.config._attn_implementation == "eager":
        # Packed shared prompts: eager attention adds its mask to the scores; sdpa takes booleans.
        inputs["attention_mask"] = torch.zeros(mask.shape, device=device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    # No KV cache: nothing is generated here, and the teacher's no-grad forward would otherwise keep one.
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden.flatten(0, 1)[batch.completion_positions.to(device)])
    return postprocess_logits(model.config, logits)


PACKING_VISION_MODELS = ("idefics3",)
"""Vision-language models whose forward passes `position_ids` and a 4-D mask to their language model
unchanged and fills image tokens in order from per-row images (tested against unpacked rows, with
images and without); others (Qwen-VL) compute positions of their own."""


def packs_shared_prompts(model) -> bool:
    """Whether `model` can score packed rows of shared prompts (`collate(packed_row_tokens=...)`): a
    text model, or an Idefics3 model (prompts with images or without), whose attention takes a 4-D
    mask (not flash-attention, which takes none)."""
    config = model.config
    text = getattr(config, "vision_config", None) is None or config.model_type in PACKING_VISION_MODELS
    return text and config._attn_implementation in ("sdpa", "eager")


def attention_pair_cost(config) -> float:
    """A query-key pair's attention against a position's linear layers, per layer: about 4 * hidden
    FLOPs (scores and values) against 2 * (4 * hidden^2 + 3 * hidden * intermediate), some
    24 * hidden^2; 1 / (6 * hidden): SmolLM2-135M 1/3456. How packed rows of several prompts are
    sized (`opsd.sequences.cheapest_rows`)."""
    return 1.0 / (6 * config.get_text_config().hidden_size)


def postprocess_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the model's own `forward` does to the LM head's output, which scoring bypasses:
    Gemma 2/3 `final_logit_softcapping`, Cohere `logit_scale`, Granite `logits_scaling`."""
    text = config.get_text_config()
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if getattr(text, "logit_scale", None) is not None and text.model_type.startswith("cohere"):
        logits = logits * text.logit_scale
    if getattr(text, "logits_scaling", None) is not None:
        logits = logits / text.logits_scaling
    return logits


class UnsupportedModelError(ValueError):
    """The model's forward computes logits that opsd's scoring would not reproduce."""


@torch.no_grad()
def check_scoring_matches_forward(model, num_tokens: int = 6, atol: float = 1e-4) -> None:
    """Refuse a model whose own `forward` post-processes logits in a way `postprocess_logits` does
    not know: scoring it would silently train on other distributions than the engine samples.

    One forward of a few text tokens, through the model's `forward` and through scoring, compared.
    """
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(1, num_tokens + 1, device=device).remainder(vocab).unsqueeze(0)
    batch = ForwardBatch(
        inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        completion_positions=torch.arange(num_tokens),
        completion_ids=ids[0],
    )
    was_training = model.training
    model.eval()
    try:
        expected = model(**batch.inputs).logits[0].float()
        got = completion_logits(model, batch).float()  # through FSDP's scoring method when sharded
    finally:
        model.train(was_training)
    if not torch.allclose(got, expected, atol=atol, rtol=atol):
        gap = (got - expected).abs().max().item()
        raise UnsupportedModelError(
            f"model type {model.config.model_type!r} ({type(model).__name__}): its forward changes the LM "
            f"head's logits in a way opsd's scoring does not reproduce (max gap {gap:.3g}); add it to "
            "opsd.scoring.postprocess_logits before training this model"
        )


def autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclass
class ScoredBatch:
    """Both roles' scores of one micro-batch, on its completion tokens in row-major order."""

    sampled_ids: torch.Tensor  # [N] the completion tokens
    engine_logprobs: torch.Tensor  # [N] the sampler's logprob of each
    student_logits: torch.Tensor  # [N, V], with grad when the caller enabled it
    teacher_logits: torch.Tensor  # [N, V], no grad (the student's, detached, for a loss without teacher)
    distill: torch.Tensor  # [N] per-token distillation term of the loss
    student_logprobs: torch.Tensor  # [N] the student's logprob of each sampled token
    guardrails: GuardrailSums = field(default_factory=GuardrailSums)
    """Sums behind the guardrail metrics (teacher top-k mass, clip share, student entropy), 0-d tensors."""
    reward: torch.Tensor | None = None
    """[N] the GRPO term a distillation kind adds (`loss.reward_weight > 0`); None without."""

    def token_losses(self, loss: Loss) -> torch.Tensor:
        """[N] per-token loss: distillation term plus CE on the sampled token (plus the reward term), weighted."""
        return weighted_loss(loss, self.distill, -self.student_logprobs, self.reward)


Timed = Callable[[str], ContextManager]
"""`timed(part)`: a context that times one part of a step (`opsd.trainer.metrics.StageTimer.part`)."""


def untimed(part: str) -> ContextManager:
    """The default `Timed`: times nothing."""
    return contextlib.nullcontext()


def pad_token_id(processor) -> int:
    """The id that pads scoring batches: the tokenizer's pad token."""
    return tokenizer_of(processor).pad_token_id


@dataclass(frozen=True)
class Scoring:
    """How a run scores its examples, built once from the config: the loss object, the compute dtype,
    the pad id, micro-batches and packing. Shared by a training step, `--check` and offline dumps."""

    loss: Loss
    dtype: str = "float32"
    """`model.dtype`: float32, or bfloat16 autocast."""
    pad_id: int = 0
    micro_batch_size: int = 1
    packed_row_tokens: int | None = None
    """The samples of one prompt share a forward of it in rows of up to this many tokens (`collate`)
    where the model allows it (`packs_shared_prompts`); the scores are the same."""
    share_prefix: bool = True
    """In packed rows, prompts that begin alike also share one forward of their common text beginning."""

    @classmethod
    def from_config(cls, cfg: Config, processor) -> "Scoring":
        return cls(build_loss(cfg.loss), cfg.model.dtype, pad_token_id(processor), cfg.micro_batch_size,
                   cfg.train.packed_row_tokens, cfg.train.share_prompt_prefix)

    def batch(self, model, prompts, completions) -> ForwardBatch:
        """`prompts` + `completions` as `model` scores them (packed shared prompts where it can)."""
        packing = self.packed_row_tokens if packs_shared_prompts(model) else None
        return collate(prompts, completions, self.pad_id, packed_row_tokens=packing,
                       image_token_id=getattr(model.config, "image_token_id", None), share_prefix=self.share_prefix,
                       pair_cost=attention_pair_cost(model.config))

    def micro_batch(self, student, teacher, micro: list[Example], timed: Timed = untimed) -> ScoredBatch:
        """Student forward (with grad when enabled), teacher forward without, per-token terms and the
        guardrail sums; `timed` times each part (collate, each forward, loss, student logprobs)."""
        device = next(student.parameters()).device
        completions = [e.completion_ids for e in micro]
        with timed("collate"):
            student_batch = self.batch(student, [e.student for e in micro], completions)
            # grpo's reference model (its KL to the initial weights) reads the student's prompt
            teacher_prompts = [e.teacher if self.loss.teacher_sees_privilege else e.student for e in micro]
            teacher_batch = self.batch(teacher, teacher_prompts, completions) if self.loss.needs_teacher else None
            sampled = student_batch.completion_ids.to(device)
            engine_logprobs = torch.tensor([lp for e in micro for lp in e.engine_logprobs], device=device)
            advantages = torch.tensor([e.advantage for e in micro for _ in e.completion_ids], device=device) \
                if self.loss.needs_advantages else None
        with autocast(device, self.dtype):
            with timed("student_forward"):
                student_logits = completion_logits(student, student_batch)
            if teacher_batch is not None:
                with timed("teacher_forward"), torch.no_grad():
                    teacher_logits = completion_logits(teacher, teacher_batch)
            else:  # no teacher forward: its scores are the student's
                teacher_logits = student_logits.detach()
        guardrails = GuardrailSums(tokens=float(sampled.numel()))
        with timed("loss"):  # the kind's term and the guardrail sums it yields (top-k mass, clip share)
            distill = self.loss.distill(student_logits, teacher_logits, sampled, engine_logprobs, guardrails,
                                        advantages=advantages)
            reward = self.loss.reward_term(student_logits, sampled, engine_logprobs, advantages) \
                if self.loss.reward_weight else None
        with timed("student_logprobs"):  # log p_S(y) (CE, the engine check) and the entropy in one pass
            ce_trains = self.loss.weights[1] > 0 and torch.is_grad_enabled()
            student_logprobs, guardrails.student_entropy = logprobs_and_entropy(
                student_logits, None if ce_trains else sampled, chunk_size=self.loss.chunk_rows)
            if ce_trains:  # log p_S(y) with its gradient
                student_logprobs = token_logprobs(student_logits, sampled)
        return ScoredBatch(sampled, engine_logprobs, student_logits, teacher_logits, distill, student_logprobs, guardrails,
                           reward)

    def examples(self, student, teacher, examples: list[Example]) -> Iterator[tuple[list[Example], ScoredBatch]]:
        """`micro_batch` over `examples` in the run's micro-batches, outside training (offline dumps,
        `--check`): `(micro_batch, scores)` pairs; gradients as the caller's context says."""
        for start in range(0, len(examples), self.micro_batch_size):
            micro = examples[start : start + self.micro_batch_size]
            yield micro, self.micro_batch(student, teacher, micro)
