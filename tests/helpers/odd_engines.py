"""Rollout engines that are wrong on purpose, named in configs as `tests.helpers.odd_engines:<Name>`."""

from __future__ import annotations

from opsd.rollout import builtin_engine


class EngineWithoutClose:
    """Everything an engine needs but `close`."""

    def __init__(self, *, cfg, model_path, processor):
        raise AssertionError("a class without close() must be refused before it is built")

    def generate(self, prompts, sampling): ...

    def begin_weight_update(self): ...

    def receive_weights(self, bucket): ...

    def end_weight_update(self): ...


class OtherPromptEngine:
    """Samples each prompt's completions from the next prompt (a bug of a custom engine): the trainer
    scores them under their own prompt, so they are not the student's samples."""

    def __init__(self, *, cfg, model_path, processor):
        self.inner = builtin_engine(cfg, model_path, processor, "hf")
        self.capabilities = self.inner.capabilities

    def generate(self, prompts, sampling):
        return self.inner.generate(prompts[1:] + prompts[:1], sampling)  # each prompt's completions: the next one's

    def begin_weight_update(self):
        self.inner.begin_weight_update()

    def receive_weights(self, bucket):
        self.inner.receive_weights(bucket)

    def end_weight_update(self):
        self.inner.end_weight_update()

    def close(self):
        self.inner.close()


class EngineLostAtThirdRollout(OtherPromptEngine):
    """The transformers engine (OtherPromptEngine's wrapping, its own prompts), lost at its third
    `generate` as a rollout server that died."""

    rollouts = 0

    def generate(self, prompts, sampling):
        from opsd.rollout import EngineLost

        self.rollouts += 1
        if self.rollouts == 3:
            raise EngineLost("rollout server http://127.0.0.1:1 stopped answering: /health failed (a test)")
        return self.inner.generate(prompts, sampling)
