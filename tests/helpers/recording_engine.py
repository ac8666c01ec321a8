"""A custom rollout engine for the tests, named in configs as
`tests.helpers.recording_engine:RecordingEngine`.

It wraps the built-in transformers engine, as a user's wrapper would (`builtin_engine`, keeping its
capabilities), and, as its weight-sync hook, appends one JSON line per update to
`<output_dir>/weight_sync_record.jsonl`: the name and byte size of every tensor synced.
"""

from __future__ import annotations

import json
from pathlib import Path

from opsd.rollout import EngineCapabilities, builtin_engine


class RecordingEngine:
    def __init__(self, *, cfg, model_path, processor):
        self.inner = builtin_engine(cfg, model_path, processor, "hf")
        self.capabilities = self.inner.capabilities
        self.record_path = Path(cfg.logging.output_dir) / "weight_sync_record.jsonl"
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        self.record_path.write_text("")
        self.model_path = model_path

    def generate(self, prompts, sampling):
        return self.inner.generate(prompts, sampling)

    def begin_weight_update(self):
        self.tensors: dict[str, int] = {}
        self.buckets = 0
        self.inner.begin_weight_update()

    def receive_weights(self, bucket):
        for name, tensor in bucket:
            assert name not in self.tensors, f"{name} sent twice in one update"
            self.tensors[name] = tensor.numel() * tensor.element_size()
        self.buckets += 1
        self.inner.receive_weights(bucket)

    def end_weight_update(self):
        self.inner.end_weight_update()
        with self.record_path.open("a") as f:
            f.write(json.dumps({"buckets": self.buckets, "tensors": self.tensors}) + "\n")

    def close(self):
        self.inner.close()


class Undeclared:
    """Has every engine method but does not say which optional abilities it has."""

    def __init__(self, **_):
        pass

    generate = begin_weight_update = receive_weights = end_weight_update = close = lambda self, *a: None


class SleepsWithoutMethod(Undeclared):
    """Declares `release_memory` but has no such method (a wrapper that forgot to forward it)."""

    capabilities = EngineCapabilities(release_memory=True)
