"""The rollout engine interface: sample completions for prompts, take new weights; sampling settings.

Any class with these methods can serve as the trainer's sampler (vLLM, transformers `generate`,
or a user's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from opsd.config import Config
from opsd.prompts import Prompt, placeholder_token_ids


@dataclass
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    """0 = greedy (evaluation), in every engine."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    n: int = 1
    """Completions per prompt."""
    seed: int = 0
    """Makes a call reproducible: the same prompts, weights and seed give the same completions."""
    banned_token_ids: list[int] = field(default_factory=list)
    """Never sampled: image placeholders in a completion would break the scoring forward."""


def sampling_settings(cfg: Config, step: int, processor, first_prompt: int = 0) -> SamplingSettings:
    """The rollout sampling of optimizer step `step` (offline dumps use the step of their checkpoint).

    Prompt i of the call samples with seed `seed + i`; `first_prompt` (the index of the call's first
    prompt in the step's global batch) makes a prompt's seed the same whichever rank samples it.
    """
    r = cfg.rollout
    return SamplingSettings(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        n=r.samples_per_prompt, seed=cfg.train.seed * 1_000_003 + step * 10_007 + first_prompt,
        banned_token_ids=placeholder_token_ids(processor),
    )


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]
    """Sampled ids, the stop token included when sampling stopped on it."""
    logprobs: list[float]
    """The engine's log-probability of each sampled token under the unmodified model distribution
    (temperature 1, no top-k/top-p), comparable with the trainer's own."""
    text: str = ""
    finish_reason: str = ""
    """`stop` or `length` (vLLM's words); empty when the engine does not say."""

    def hit_token_limit(self, max_new_tokens: int) -> bool:
        """Sampling ended at `max_new_tokens`, not on a stop token."""
        return self.finish_reason == "length" if self.finish_reason else len(self.token_ids) >= max_new_tokens


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        """`sampling.n` completions per prompt, prompt-major order."""

    # Weight sync (see opsd/rollout/weight_sync.py): one session per optimizer step.
    def begin_weight_update(self) -> None: ...

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A bucket of `(hf_name, full_tensor)` pairs, named as in the Hugging Face checkpoint."""

    def end_weight_update(self) -> None:
        """All buckets are in: the next `generate` must use the new weights."""

    def close(self) -> None: ...

    # Optional: `release_memory()`, called after the step's rollouts and before training, always
    # followed by a weight update before the next `generate` (the colocated vLLM engine sleeps there).
