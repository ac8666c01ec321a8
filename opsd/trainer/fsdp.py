"""FSDP2 (`fully_shard`) for the student and the frozen teacher, and gradient sync for accumulation.

Each transformer block (every entry of the model's outermost `nn.ModuleList`s: the decoder layers,
the vision encoder layers) is its own FSDP unit; the root unit holds the rest (embeddings, norms,
LM head, vision embeddings, connector). Parameter names stay the Hugging Face ones, so the weight
sync and the optimizer see the same names as in a single process.
"""

from __future__ import annotations

import types

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

from opsd.config import DistributedConfig
from opsd.scoring import SCORING_METHOD, forward_completion_logits
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


def shard_model(model: nn.Module, ranks: Ranks, cfg: DistributedConfig, *, trainable: bool) -> nn.Module:
    """Shard `model` in place over `ranks.mesh`; a frozen model (`trainable=False`) may live on the CPU."""
    if trainable and cfg.activation_checkpointing:
        # Non-reentrant checkpointing keeps FSDP's hooks working in the recomputed forward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload = (
        CPUOffloadPolicy()
        if not trainable and cfg.cpu_offload_teacher and ranks.device.type == "cuda"
        else OffloadPolicy()
    )
    options = dict(
        mesh=ranks.mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]),
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


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce gradients over ranks in this backward (the last micro-step) or only accumulate them."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it); a plain tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
