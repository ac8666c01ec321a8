"""An engine that answers without a model, named in configs as `tests.helpers.scripted_engine:AnswerEngine`:
`<answer>X</answer>` where the prompt holds `Reference answer: X` (a teacher prompt with
`prompts.privileged: [answer]`), else `<answer>unknown</answer>`; weight syncs are accepted and dropped."""

from __future__ import annotations

import re

from opsd.rollout import EngineCapabilities
from opsd.rollout.engine import Completion


class AnswerEngine:
    capabilities = EngineCapabilities()

    def __init__(self, *, cfg, model_path, processor):
        self.model_path = model_path

    def generate(self, prompts, sampling):
        out = []
        for i, prompt in enumerate(prompts):
            found = re.search(r"Reference answer: (\S+)", prompt.text)
            text = f"<answer>{found.group(1) if found else 'unknown'}</answer>"
            out += [Completion(prompt_index=i, token_ids=[1], logprobs=[0.0], text=text) for _ in range(sampling.n)]
        return out

    def begin_weight_update(self): ...

    def receive_weights(self, bucket): ...

    def end_weight_update(self): ...

    def close(self): ...
