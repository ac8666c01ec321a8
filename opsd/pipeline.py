"""A step's data up to scoring, written once for training, `--check` and offline dumps:

    samples -> student prompts -> completions -> student and teacher sequences (examples)

The completions are sampled by the rollout engine with the step's sampling settings, or, for a loss
kind that does not sample (`loss.kind=sft`), are each sample's privileged text. Scoring the examples
is `opsd.scoring.Scoring`'s job (inside the train step, or `Scoring.examples` outside training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opsd.config import Config
from opsd.data.sample import Sample
from opsd.prompts import Prompt, student_prompt, teacher_prompt, tokenizer_of
from opsd.rollout import Completion, RolloutEngine, sampling_settings
from opsd.sequences import Example, build_examples, encode_prompt


@dataclass
class Rollout:
    """One call's samples, their student prompts and the completions, `n` per prompt, prompt-major."""

    samples: list[Sample]
    prompts: list[Prompt]
    completions: list[Completion]


def sample_rollout(engine: RolloutEngine, samples: list[Sample], processor, cfg: Config, step: int, *,
                   first_prompt: int = 0, on_policy: bool = True) -> Rollout:
    """Student prompts of `samples` and completions sampled from the engine's (the student's) weights
    with the sampling settings of `step` (`first_prompt`: see `sampling_settings`); `on_policy=False`:
    each sample's privileged text instead, `rollout.samples_per_prompt` times."""
    prompts = [student_prompt(s, processor, cfg.prompts) for s in samples]
    if not on_policy:
        return Rollout(samples, prompts, reference_completions(samples, processor, cfg.rollout.samples_per_prompt))
    return Rollout(samples, prompts, engine.generate(prompts, sampling_settings(cfg, step, processor, first_prompt)))


def reference_completions(samples: list[Sample], processor, n: int) -> list[Completion]:
    """The supervised baseline's "completions": each sample's privileged text and the end-of-turn
    token, as the tokenizer writes them; no sampler, so no engine logprobs (NaN)."""
    tokenizer = tokenizer_of(processor)
    completions = []
    for index, s in enumerate(samples):
        ids = tokenizer(s.privileged_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        completions += [Completion(index, ids, [math.nan] * len(ids), text=s.privileged_text, finish_reason="stop")] * n
    return completions


def rollout_examples(rollout: Rollout, processor, cfg: Config, *, privileged: bool = True,
                     advantages: list[float] | None = None) -> tuple[list[Example], dict[str, int]]:
    """Each completion between its student prompt and its teacher prompt (`privileged=False`: the
    student prompt again, teacher = student), cut to fit `train.max_forward_tokens`, with its reward
    advantage (`advantages`, one per completion; None = 0); with the counts of what was cut or dropped."""
    students = [encode_prompt(processor, p) for p in rollout.prompts]
    teachers = [encode_prompt(processor, teacher_prompt(s, processor, cfg.prompts)) for s in rollout.samples] if privileged else students
    return build_examples(students, teachers, [s.id for s in rollout.samples], rollout.completions, cfg.train.max_forward_tokens,
                          advantages)
