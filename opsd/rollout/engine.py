"""The rollout engine interface: sample completions for prompts, take new weights; sampling settings.

Any class with the methods of `RolloutEngine` and a `capabilities` attribute can serve as the
trainer's sampler (vLLM, transformers `generate`, a separate vLLM server, or a user's own). The
optional abilities are declared in `capabilities` (`EngineCapabilities`), never guessed from what
methods an object happens to have: a wrapper around another engine states which of the wrapped
engine's abilities it keeps (usually all: `self.capabilities = inner.capabilities`, with the
methods forwarded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from opsd.config import Config
from opsd.prompts import Prompt, placeholder_token_ids


@dataclass
class SamplingSettings:
    """How one `generate` call samples; an engine follows every field as given."""

    max_new_tokens: int
    temperature: float = 1.0
    """0 = greedy (evaluation), in every engine."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    n: int = 1
    """Completions per prompt (1 whenever `temperature` is 0: vLLM refuses several greedy ones)."""
    seed: int = 0
    """Makes a call reproducible: the same prompts, weights and seed give the same completions."""
    banned_token_ids: list[int] = field(default_factory=list)
    """Never sampled: image placeholders in a completion would break the scoring forward."""

    @classmethod
    def greedy(cls, max_new_tokens: int, banned_token_ids: list[int] = ()) -> "SamplingSettings":
        """The evaluation's call: one greedy completion per prompt (temperature 0, n 1, no top-p or
        top-k, seed 0)."""
        return cls(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, n=1, seed=0,
                   banned_token_ids=list(banned_token_ids))


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


def generate_once(prompt_lists: list[list[Prompt]], engine, settings: SamplingSettings) -> list[list[str]]:
    """Completions of several prompt lists from one engine call (one batch keeps the engine busy),
    each distinct prompt generated once (without privileged information the teacher's prompt is the
    student's); the texts come back in the lists' shape."""
    def key(prompt: Prompt) -> tuple:
        return (prompt.text, *map(id, prompt.images))

    distinct = {key(p): p for prompts in prompt_lists for p in prompts}
    keys = list(distinct)
    # A tensor-parallel engine samples as a group: every rank of it calls, even with nothing to ask.
    collective = engine.capabilities.generate_is_collective
    completions = engine.generate(list(distinct.values()), settings) if distinct or collective else []
    text_of = {keys[c.prompt_index]: c.text for c in completions}
    return [[text_of[key(p)] for p in prompts] for prompts in prompt_lists]


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


class WeightReceiver(Protocol):
    """Takes the trainer's weights: one update session per optimizer step (opsd/rollout/weight_sync.py).

    Every rollout engine is one; so is anything else the weights should go to (a file writer,
    opsd/rollout/receivers.py).
    """

    def begin_weight_update(self) -> None: ...

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A bucket of `(hf_name, full_tensor)` pairs, named as in the Hugging Face checkpoint."""

    def end_weight_update(self) -> None:
        """All buckets are in: the next `generate` must use the new weights."""


@dataclass(frozen=True)
class EngineCapabilities:
    """The optional abilities of a rollout engine. opsd uses exactly those declared here, and an engine
    declaring one has its method; the default is none of them."""

    release_memory: bool = False
    """It has `release_memory()`: called after each step's rollouts, before training, and always
    followed by a weight update before the next `generate` (the colocated vLLM engine sleeps there)."""
    generate_is_collective: bool = False
    """Every rank of a group must call `generate`, with or without prompts of its own (a
    tensor-parallel engine spread over torchrun ranks); evaluation then calls it on every rank."""
    weight_dtype: torch.dtype | None = None
    """The dtype it holds its weights in: the weight sync gathers and sends them in it (bfloat16 moves
    half the bytes of float32). None: as the trainer holds them."""
    receive_adapter: bool = False
    """It has `receive_adapter(update: opsd.lora.AdapterUpdate)` and samples with the LoRA adapter it
    was last given, base weights unchanged (`rollout.lora_sync: adapter` needs it)."""
    checkpoint_names: bool = False
    """It loads weights the way it loads a checkpoint (vLLM): the sync sends each tensor under the name
    `save_pretrained` writes for it (`weight_sync.checkpoint_names`), not the loaded model's."""
    discards_weights: bool = False
    """`release_memory` drops the weights it was sent (vLLM asleep at level 2 on a GPU): every update
    must bring all of them, a frozen vision tower's too (`sync_student`'s `exclude`)."""


class EngineLost(RuntimeError):
    """The engine stopped answering (a rollout server that died or froze); the message says which and
    since when. Any engine may raise it from `generate` or the weight update: the run then saves its
    last completed step and exits with status 4 (docs/faults.md)."""


class RolloutEngine(WeightReceiver, Protocol):
    """A sampler the trainer keeps on-policy: `generate`, the weight update of `WeightReceiver`,
    `close`, and its declared optional abilities (`capabilities`)."""

    capabilities: EngineCapabilities

    def generate(self, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
        """`sampling.n` completions per prompt, prompt-major order, sampled exactly as `sampling` says
        (the evaluation calls it with `SamplingSettings.greedy`). A prompt carries its rendered `text`
        and `images`, and the `system` message and user `parts` they were rendered from."""

    def close(self) -> None: ...

    # Optional, when `capabilities` declares them (see `EngineCapabilities`):
    # def release_memory(self) -> None: ...
    # def receive_adapter(self, update) -> None: ...
