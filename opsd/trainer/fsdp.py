"""FSDP2 (`fully_shard`) for the student and the frozen teacher, and gradient sync for accumulation.

Each transformer block (every entry of the model's outermost `nn.ModuleList`s: the decoder layers,
the vision encoder layers) is its own FSDP unit; the root unit holds the rest (embeddings, norms,
LM head, vision embeddings, connector). Parameter names stay the Hugging Face ones, so the weight
sync and the optimizer see the same names as in a single process.

Host memory: the weights are read once per process group. Every rank shards an empty model (meta
parameters), rank 0 alone reads the weight files, and `set_model_state_dict(...,
broadcast_from_rank0=True)` sends each rank its shards. An EMA / fixed teacher is a copy of the
student's shards, never of a full model.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from opsd.config import DistributedConfig
from opsd.scoring import SCORING_METHOD, forward_completion_logits
from opsd.teacher import local_tensor
from opsd.trainer.distributed import Ranks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Entries of the outermost `nn.ModuleList`s (lists nested in a block stay inside it)."""
    blocks, lists = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(outer + ".") for outer in lists):
            lists.append(name)
            blocks.extend(module)
    return blocks


def shard_model(model: nn.Module, ranks: Ranks, cfg: DistributedConfig, *, trainable: bool,
                param_dtype: str | None = None) -> nn.Module:
    """Shard `model` in place over `ranks.mesh`; a frozen model (`trainable=False`) may live on the CPU.
    `param_dtype`: the dtype its units gather in, instead of `distributed.param_dtype` (a model
    teacher held in bfloat16 gathers in bfloat16)."""
    offload = CPUOffloadPolicy() if _offloaded(ranks, cfg, trainable) else OffloadPolicy()
    gathered = DTYPES["bfloat16"] if param_dtype == "bfloat16" else DTYPES[cfg.param_dtype]
    options = dict(
        mesh=ranks.mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=DTYPES[cfg.reduce_dtype]),
        offload_policy=offload,
    )
    for block in transformer_blocks(model):
        fully_shard(block, **options)
    # A frozen model never runs backward, where a root would free its gathered parameters: free
    # them right after each forward instead.
    fully_shard(model, **options, reshard_after_forward=None if trainable else True)
    # Scoring calls the inner model and the LM head, not `model.forward`; registering it as a forward
    # method makes FSDP gather (and afterwards free) the root unit's parameters around it.
    setattr(model, SCORING_METHOD, types.MethodType(forward_completion_logits, model))
    register_fsdp_forward_method(model, SCORING_METHOD)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average, gradients over ranks: each rank's loss is already divided by the
            # tokens of all ranks (global token normalisation), so the sum is the global gradient.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _offloaded(ranks: Ranks, cfg: DistributedConfig, trainable: bool) -> bool:
    return not trainable and cfg.cpu_offload_teacher and ranks.device.type == "cuda"


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a sharded empty model's shards on `device`, keeping its (unsharded, real) buffers."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def load_sharded(
    empty: nn.Module, read_full_state_dict: Callable[[], dict], ranks: Ranks, cfg: DistributedConfig, *, trainable: bool,
    param_dtype: str | None = None,
) -> nn.Module:
    """Shard `empty` (meta parameters, real buffers), then fill every rank's shards with the weights
    rank 0 alone reads (`read_full_state_dict` runs there only; cast to the shards' dtype)."""
    shard_model(empty, ranks, cfg, trainable=trainable, param_dtype=param_dtype)
    _materialize(empty, torch.device("cpu") if _offloaded(ranks, cfg, trainable) else ranks.device)
    full = read_full_state_dict() if ranks.is_main else {}
    set_model_state_dict(empty, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return empty


def copy_of_shards(empty: nn.Module, source: nn.Module, ranks: Ranks, cfg: DistributedConfig) -> nn.Module:
    """A frozen model with `source`'s weights, built shard by shard (the EMA / fixed teacher)."""
    shard_model(empty, ranks, cfg, trainable=False)
    _materialize(empty, torch.device("cpu") if _offloaded(ranks, cfg, False) else ranks.device)
    with torch.no_grad():
        for target, param in zip(empty.parameters(), source.parameters(), strict=True):
            local_tensor(target).copy_(local_tensor(param.detach()))
    return empty.eval().requires_grad_(False)


def set_gradient_sync(model: nn.Module, last_micro_step: bool) -> None:
    """Reduce-scatter gradients in every micro-step's backward, so each rank only ever holds its
    float32 gradient shards (skipping it would keep every parameter's unsharded gradient until the
    last micro-step: ~33 GB per rank at 7B). Under hybrid sharding the replicas' all-reduce of the
    accumulated shards waits for the last micro-step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(last_micro_step)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it); a plain tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
