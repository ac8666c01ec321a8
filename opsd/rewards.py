"""Rewards of sampled completions (the `reward` section): reward functions, their weighted sum, and
GRPO's group-relative advantages over each prompt's samples.

A reward function is called as `function(sample, text, token_ids) -> float`: the `Sample` (its
`answer`, `id`, question, ...), the completion's text and its sampled token ids. The built-ins
(`REWARD_BUILTINS` in opsd/config.py) check the answer as evaluation does (opsd/answers.py); any
other is a `package.module:function` import path. Every sampled completion gets the weighted sum of
all functions; `group_advantages` (opsd/loss.py) turns each prompt's rewards into advantages, here,
before the step's examples are cut into micro-batches, so a prompt's group is never split. A
function that raises or returns something other than a finite number stops the run with one line
naming the function and the sample (`RewardError`, exit status 2).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from opsd.answers import extract_answer, is_correct
from opsd.config import RewardConfig
from opsd.data.sample import Sample
from opsd.loss import group_advantages

RewardFunction = Callable[[Sample, str, list[int]], float]
"""`function(sample, completion_text, completion_token_ids) -> float`."""


class RewardError(ValueError):
    """A reward function cannot be loaded, raised, or returned a value that is not a finite number."""


def answer_match(pattern: str) -> RewardFunction:
    """1.0 when the completion's answer equals the sample's reference after normalisation, else 0.0."""
    return lambda sample, text, token_ids: float(sample.answer is not None and is_correct(text, sample.answer, pattern))


def answer_format(pattern: str) -> RewardFunction:
    """1.0 when the completion has an answer (`pattern` matches), right or wrong, else 0.0."""
    return lambda sample, text, token_ids: float(extract_answer(text, pattern) is not None)


def answer_contains(pattern: str) -> RewardFunction:
    """1.0 when the reference answer appears in the completion as a whole word (case aside), else 0.0."""
    def reward(sample: Sample, text: str, token_ids: list[int]) -> float:
        if not sample.answer:
            return 0.0
        return float(re.search(rf"(?<!\w){re.escape(sample.answer.strip())}(?!\w)", text, flags=re.IGNORECASE) is not None)
    return reward


BUILTINS: dict[str, Callable[[str], RewardFunction]] = {
    "answer_match": answer_match, "answer_format": answer_format, "answer_contains": answer_contains,
}
"""Built-in name -> factory taking the answer pattern (the names are `REWARD_BUILTINS`)."""


def load_reward_function(name: str, pattern: str) -> RewardFunction:
    """A built-in by name, or the function at an import path `package.module:function`."""
    if name in BUILTINS:
        return BUILTINS[name](pattern)
    module_name, _, attr = name.partition(":")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as err:
        raise RewardError(f"reward function {name}: cannot import it ({type(err).__name__}: {err})") from None
    if not callable(target):
        raise RewardError(f"reward function {name}: {type(target).__name__} is not callable")
    return target


@dataclass
class StepRewards:
    """One step's rewards on this rank: per completion (rollout order), per function, the advantages."""

    rewards: list[float]
    by_function: dict[str, list[float]]
    advantages: list[float]
    groups: list[list[int]]
    """Completion indices of each prompt's samples."""

    def sums(self) -> list[float]:
        """Sums behind the step's reward metrics, to be added over ranks before `reward_metrics`:
        completions, the reward, each function, prompts, within-prompt std, prompts all alike."""
        stds = [_std([self.rewards[i] for i in g]) for g in self.groups]
        flat = [float(len({self.rewards[i] for i in g}) == 1) for g in self.groups]
        return [float(len(self.rewards)), sum(self.rewards), *(sum(v) for v in self.by_function.values()),
                float(len(self.groups)), sum(stds), sum(flat)]


def _std(values: Sequence[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).std()) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Rewards:
    """The run's reward functions and weights, built once (imports resolved at the start)."""

    functions: tuple[tuple[str, float, RewardFunction], ...]
    scale_by_std: bool = True
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(name for name, _, _ in self.functions))

    @classmethod
    def from_config(cls, cfg: RewardConfig, default_pattern: str) -> "Rewards":
        pattern = cfg.answer_pattern or default_pattern
        return cls(tuple((f.name, f.weight, load_reward_function(f.name, pattern)) for f in cfg.functions), cfg.scale_by_std)

    def score(self, samples: list[Sample], completions: list) -> StepRewards:
        """Every completion's reward (`completion.prompt_index` names its sample) and its advantage
        within its prompt's group."""
        by_function = {name: [] for name in self.names}
        rewards = []
        for c in completions:
            sample = samples[c.prompt_index]
            total = 0.0
            for name, weight, function in self.functions:
                value = call_reward(name, function, sample, c.text, list(c.token_ids))
                by_function[name].append(value)
                total += weight * value
            rewards.append(total)
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(completions):
            groups.setdefault(c.prompt_index, []).append(i)
        advantages = [0.0] * len(completions)
        for members in groups.values():
            if len(members) < 2:
                continue  # a lone sample (its siblings dropped) has nothing to be compared with
            group = torch.tensor([[rewards[i] for i in members]], dtype=torch.float64)
            for i, a in zip(members, group_advantages(group, scale_by_std=self.scale_by_std)[0].tolist()):
                advantages[i] = a
        return StepRewards(rewards, by_function, advantages, list(groups.values()))


def call_reward(name: str, function: RewardFunction, sample: Sample, text: str, token_ids: list[int]) -> float:
    """`function(sample, text, token_ids)` as a float; a `RewardError` naming the function and the
    sample when it raises or returns something other than a finite number."""
    try:
        value = function(sample, text, token_ids)
    except Exception as err:  # the user's code: any failure is reported the same way
        detail = " ".join(f"{type(err).__name__}: {err}".split())
        raise RewardError(f"reward function {name} raised on sample {sample.id}: {detail}") from err
    if not isinstance(value, numbers.Real) and not (torch.is_tensor(value) and value.numel() == 1):
        raise RewardError(f"reward function {name} returned {type(value).__name__} on sample {sample.id}: it must return a float")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward function {name} returned {value} on sample {sample.id}: rewards must be finite")
    return value


def reward_metrics(names: Sequence[str], sums: Sequence[float]) -> dict[str, float]:
    """The step's `reward/*` metrics from `StepRewards.sums` added over ranks."""
    completions, total, *rest = sums
    per_function, (prompts, std_sum, flat) = rest[: len(names)], rest[len(names):]
    if not completions:
        return {}
    metrics = {"reward/mean": total / completions}
    metrics.update({f"reward/{name}": value / completions for name, value in zip(names, per_function)})
    metrics["reward/within_prompt_std"] = std_sum / prompts
    metrics["reward/all_alike_fraction"] = flat / prompts
    return metrics
