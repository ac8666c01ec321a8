"""vLLM worker extension for the out-of-process engine: load weight buckets staged as files.

`vllm serve ... --worker-extension-cls opsd.rollout.server_worker.WeightSyncExtension` mixes these
methods into every vLLM worker; `ServerEngine` calls them through the server's `/collective_rpc`
endpoint (dev mode), which passes only strings: tensors cannot travel through it, so each bucket
is written to a safetensors file (on /dev/shm) and the worker reads it. One update runs as one
session (opsd/rollout/vllm_reload.py), as in the colocated engine: a session per bucket would
process a fused layer (qkv, gate_up) with half its shards loaded.
"""

from __future__ import annotations

from safetensors.torch import load_file

from opsd.rollout.vllm_reload import begin_reload, finish_reload, load_bucket


class WeightSyncExtension:
    """Methods are prefixed so they cannot collide with the worker's own attributes."""

    def opsd_ping(self) -> str:
        return "ok"

    def opsd_begin_weight_update(self) -> None:
        begin_reload(self)

    def opsd_load_weights_file(self, path: str) -> int:
        bucket = list(load_file(path).items())
        load_bucket(self, bucket)
        return len(bucket)

    def opsd_finish_weight_update(self, *flags: str) -> None:
        finish_reload(self, keep_image_encodings="keep_image_encodings" in flags)
