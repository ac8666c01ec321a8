"""Weight sync: stream the trainer's weights into a rollout engine in size-bounded buckets.

A receiver (any rollout engine, or a user's own object pushing weights elsewhere) gets one update
session per optimizer step: `begin_weight_update()`, then `receive_weights(bucket)` for each bucket
of `(hf_name, full_tensor)` pairs, then `end_weight_update()`. Buckets bound the memory of the
gathered full tensors (never the whole state dict at once) and keep per-call overhead low.

A LoRA student (opsd/lora.py) syncs either its adapter alone (`receive_adapter`, megabytes) or its
weights with the adapter merged in, through the same buckets (`rollout.lora_sync`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

from opsd import lora
from opsd.config import ConfigError


class WeightReceiver(Protocol):
    def begin_weight_update(self) -> None: ...

    def receive_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None: ...

    def end_weight_update(self) -> None: ...

    # Optional, for `rollout.lora_sync=adapter`: `receive_adapter(update: opsd.lora.AdapterUpdate)`
    # replaces the adapter the engine samples with (the base weights stay).


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    buckets: int
    tensors: int


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter; sharded (DTensor) ones are gathered one at a time."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def push_weights(model: torch.nn.Module, receiver: WeightReceiver, *, bucket_mb: float = 256) -> SyncStats:
    """One update session: every parameter of `model`, in buckets, into `receiver`."""
    return push_tensors(full_tensors(model), receiver, bucket_mb=bucket_mb)


def push_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], receiver: WeightReceiver, *, bucket_mb: float = 256) -> SyncStats:
    """One update session: `(hf_name, full_tensor)` pairs, in buckets, into `receiver`."""
    start = time.perf_counter()
    total_bytes = count = n_buckets = 0
    receiver.begin_weight_update()
    for bucket in buckets(named_tensors, int(bucket_mb * 2**20)):
        receiver.receive_weights(bucket)
        n_buckets += 1
        count += len(bucket)
        total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    receiver.end_weight_update()
    return SyncStats(time.perf_counter() - start, total_bytes, n_buckets, count)


def sync_student(model: torch.nn.Module, receiver, *, bucket_mb: float = 256, lora_sync: str = "adapter") -> SyncStats:
    """The engine gets the student: all weights, or for a LoRA student its adapter (`lora_sync=adapter`)
    or its weights with the adapter merged in (`merged`)."""
    if not lora.is_lora(model):
        return push_weights(model, receiver, bucket_mb=bucket_mb)
    if lora_sync == "merged":
        return push_tensors(lora.merged_tensors(model), receiver, bucket_mb=bucket_mb)
    start = time.perf_counter()
    update = lora.adapter_update(model)
    receiver.receive_adapter(update)
    return SyncStats(time.perf_counter() - start, update.bytes, 1, len(update.tensors))


def check_adapter_receiver(receiver) -> None:
    """`rollout.lora_sync=adapter` needs an engine that serves adapters; say so before training starts."""
    if not callable(getattr(receiver, "receive_adapter", None)):
        raise ConfigError(
            f"rollout.lora_sync=adapter: the rollout engine {type(receiver).__name__} has no receive_adapter(update) "
            "method; set rollout.lora_sync=merged to push full weights with the adapter merged in"
        )
