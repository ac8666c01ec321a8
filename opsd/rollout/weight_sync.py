"""Weight sync: stream the trainer's weights into a rollout engine in size-bounded buckets.

A receiver (`WeightReceiver`, opsd/rollout/engine.py: any rollout engine, or a user's own object
pushing weights elsewhere) gets one update session per optimizer step: `begin_weight_update()`,
then `receive_weights(bucket)` for each bucket of `(hf_name, full_tensor)` pairs, then
`end_weight_update()`. Buckets bound the memory of the gathered full tensors (never the whole state
dict at once) and keep per-call overhead low; a tensor larger than a bucket travels alone.

Tensors go in `dtype` when one is given (an engine's `capabilities.weight_dtype`: the vLLM engines
hold bfloat16 weights in bfloat16 runs), cast before anything else happens to them, and under the
names `names` gives (an engine that loads weights the way it loads a checkpoint, vLLM, declares
`capabilities.checkpoint_names` and gets each tensor under the name `save_pretrained` writes for it:
transformers 5 renames some models' weights when it loads them and back when it saves, PaddleOCR-VL's
`model.language_model.*` is `model.*` on disk). Sharded (FSDP2)
models are gathered one FSDP unit at a time (a transformer block, or the root's embeddings and
head), every parameter of the unit in one all-gather of its shards already cast to that dtype:
bfloat16 weights move half the bytes of float32 ones.

A LoRA student (opsd/lora.py) syncs either its adapter alone (`receive_adapter`, megabytes) or its
weights with the adapter merged in, through the same buckets (`rollout.lora_sync`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from opsd import lora
from opsd.config import ConfigError
from opsd.rollout.engine import RolloutEngine, WeightReceiver


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    """Bytes of the full tensors pushed into the receiver."""
    buckets: int
    tensors: int
    gathered_bytes: int = 0
    """Bytes this rank received from all-gathers of shards (0 in a single process)."""


def _units(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The parameters grouped by the FSDP unit that owns them (the innermost FSDP module around them);
    one group per parameter of a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    prefixes = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not prefixes:
        return [[(name, param)] for name, param in model.named_parameters()]
    groups: dict[str, list] = {prefix: [] for prefix in prefixes}
    for name, param in model.named_parameters():
        owner = max((p for p in prefixes if p == "" or name.startswith(p + ".")), key=len)
        groups[owner].append((name, param))
    return [group for group in groups.values() if group]


def _gather_unit(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, counter: list[int]):
    """Full tensors of one unit's DTensor parameters (sharded on dim 0 over one mesh dimension, the
    FSDP2 layout) from a single all-gather of their local shards, cast to `dtype` first."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh, placements = params[0][1].device_mesh, params[0][1].placements
    shard_dim = next(i for i, p in enumerate(placements) if isinstance(p, Shard))
    group, world = mesh.get_group(shard_dim), mesh.size(shard_dim)
    pieces, layout = [], []
    for name, param in params:
        local = param.detach().to_local()
        local = local.to(dtype) if dtype is not None else local
        rows = -(-param.shape[0] // world)  # torch.chunk: every rank but the last ones holds `rows`
        padded = local.new_zeros((rows, *param.shape[1:]))
        padded[: local.shape[0]] = local
        pieces.append(padded.flatten())
        layout.append((name, param.shape, rows, padded.numel()))
    send = torch.cat(pieces)
    received = send.new_empty(world * send.numel())
    dist.all_gather_into_tensor(received, send, group=group)
    counter[0] += received.numel() * received.element_size()
    received = received.view(world, -1)
    offset = 0
    for name, shape, rows, numel in layout:
        per_rank = received[:, offset : offset + numel].reshape(world * rows, *shape[1:])
        yield name, per_rank[: shape[0]]
        offset += numel


def full_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None, counter: list[int] | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) for every parameter not in `exclude`; a sharded model is
    gathered unit by unit, the excluded parameters not at all (`counter[0]` adds up the bytes received)."""
    counter = counter if counter is not None else [0]
    for unit in _units(model):
        unit = [(name, param) for name, param in unit if name not in exclude]
        if not unit:
            continue
        if hasattr(unit[0][1], "to_local"):
            yield from _gather_unit(unit, dtype, counter)
        else:
            for name, param in unit:
                tensor = param.detach()
                yield name, tensor.to(dtype) if dtype is not None else tensor


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


def checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the name `save_pretrained` writes for it, where the two differ (transformers'
    own reverse weight conversion, asked once per model). A conversion that does more than rename
    (fusing or splitting tensors) is refused: the engine would need the converted tensors."""
    cached = getattr(model, "_opsd_checkpoint_names", None)
    if cached is not None:
        return cached
    from transformers.core_model_loading import revert_weight_conversion

    # The names a receiver gets: the parameters', or for a LoRA student those of its merged weights.
    names = [name.replace(".base_layer.", ".") for name, _ in model.named_parameters() if ".lora_" not in name]
    # Each name carries its index through the conversion; a pure renaming returns every index once.
    reverted = revert_weight_conversion(model, {name: torch.tensor([i]) for i, name in enumerate(names)})
    indices = [t.reshape(-1).tolist() for t in reverted.values()]
    if sorted(i for index in indices for i in index) != list(range(len(names))) or any(len(i) != 1 for i in indices):
        raise ConfigError(f"weight sync: transformers converts the weights of {type(model).__name__} on save beyond "
                          "renaming them; opsd cannot hand them to an engine that loads checkpoint names")
    mapping = {names[index[0]]: saved for saved, index in zip(reverted, indices) if names[index[0]] != saved}
    model._opsd_checkpoint_names = mapping
    return mapping


def push_weights(model: torch.nn.Module, receiver: WeightReceiver, *, bucket_mb: float = 256,
                 dtype: torch.dtype | None = None, names: dict[str, str] | None = None,
                 exclude: frozenset[str] = frozenset()) -> SyncStats:
    """One update session: every parameter of `model` but those in `exclude` (weights the receiver
    already holds: a frozen vision tower), in buckets, into `receiver` (gathered in `dtype` when
    given, renamed by `names`)."""
    gathered = [0]
    stats = push_tensors(full_tensors(model, dtype, gathered, exclude), receiver, bucket_mb=bucket_mb, dtype=dtype,
                         names=names)
    stats.gathered_bytes = gathered[0]
    return stats


def push_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], receiver: WeightReceiver, *, bucket_mb: float = 256,
                 dtype: torch.dtype | None = None, names: dict[str, str] | None = None) -> SyncStats:
    """One update session: `(hf_name, full_tensor)` pairs, in `dtype` when given, renamed by `names`
    (`checkpoint_names`), in buckets, into `receiver`."""
    if dtype is not None:
        named_tensors = ((name, t.to(dtype)) for name, t in named_tensors)  # a no-op when gathered in it
    if names:
        named_tensors = ((names.get(name, name), t) for name, t in named_tensors)
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


def sync_student(model: torch.nn.Module, engine: RolloutEngine, *, bucket_mb: float = 256, lora_sync: str = "adapter",
                 exclude: frozenset[str] = frozenset()) -> SyncStats:
    """The engine gets the student, in its `capabilities.weight_dtype`: all weights, or for a LoRA
    student its adapter (`lora_sync=adapter`) or its weights with the adapter merged in (`merged`).
    Never the weights named in `exclude` (a frozen vision tower the engine already holds), unless the
    engine discards its weights while released (`capabilities.discards_weights`)."""
    capabilities = engine.capabilities
    dtype = capabilities.weight_dtype
    names = checkpoint_names(model) if capabilities.checkpoint_names else None
    exclude = frozenset() if capabilities.discards_weights else exclude
    if not lora.is_lora(model):
        return push_weights(model, engine, bucket_mb=bucket_mb, dtype=dtype, names=names, exclude=exclude)
    if lora_sync == "merged":
        return push_tensors(lora.merged_tensors(model, exclude=exclude), engine, bucket_mb=bucket_mb, dtype=dtype,
                            names=names)
    start = time.perf_counter()
    update = lora.adapter_update(model)
    engine.receive_adapter(update)
    return SyncStats(time.perf_counter() - start, update.bytes, 1, len(update.tensors))


def check_adapter_receiver(engine: RolloutEngine) -> None:
    """`rollout.lora_sync=adapter` needs an engine that serves adapters; say so before training starts."""
    if not engine.capabilities.receive_adapter:
        raise ConfigError(
            f"rollout.lora_sync=adapter: the rollout engine {type(engine).__name__} has no receive_adapter (its "
            "capabilities.receive_adapter is false); set rollout.lora_sync=merged to push full weights with the adapter merged in"
        )
