"""Weight receivers that need no inference engine: the weight-sync hook in its plainest form.

Any object with `begin_weight_update()`, `receive_weights(bucket)` and `end_weight_update()` is a
`WeightReceiver` (opsd/rollout/weight_sync.py). `SafetensorsWriter` stores every update as a
sharded Hugging Face checkpoint directory (one file per bucket plus the standard index), ready
for another process or host to pick up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"  # the name transformers and vLLM look for


def save_bucket(bucket: list[tuple[str, torch.Tensor]], path: str | Path) -> int:
    """Write one bucket of `(name, tensor)` pairs as a safetensors file; returns its tensor bytes."""
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in bucket}
    save_file(tensors, str(path))
    return sum(t.numel() * t.element_size() for t in tensors.values())


class SafetensorsWriter:
    """Each update replaces `directory` with `bucket-00000.safetensors`, ... and the index.

    The index is written last, so its presence marks a complete update (a reader polling the
    directory never sees a half-written one as complete).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.updates = 0

    def begin_weight_update(self) -> None:
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)
        self._weight_map: dict[str, str] = {}
        self._bytes = 0

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        file_name = f"bucket-{len(set(self._weight_map.values())):05d}.safetensors"
        self._bytes += save_bucket(bucket, self.directory / file_name)
        self._weight_map.update({name: file_name for name, _ in bucket})

    def end_weight_update(self) -> None:
        index = {"metadata": {"total_size": self._bytes}, "weight_map": self._weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=1))
        self.updates += 1
