"""A vLLM engine sharing torchrun ranks with the trainer: engine arguments, tensor-parallel groups.

Under torchrun every rank starts its own in-process engine with vLLM's external launcher
(`distributed_executor_backend="external_launcher"`): vLLM then joins the process group torchrun and
the trainer already set up instead of creating its own. With `tensor_parallel_size` k, consecutive
groups of k ranks form one tensor-parallel engine: every rank of a group must submit the same
requests, so the group gathers its prompts, generates them all, and each rank keeps its own.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from opsd.device import process_world_size
from opsd.prompts import Prompt
from opsd.rollout.engine import Completion, SamplingSettings


def engine_kwargs(*, tensor_parallel_size: int) -> dict:
    """Extra `vllm.LLM` arguments for this process: external launcher under torchrun."""
    world_size = process_world_size()
    if world_size == 1:
        if tensor_parallel_size > 1:
            raise ValueError(
                "rollout.tensor_parallel_size > 1 needs torchrun: each rank of a group hosts one shard of the engine"
            )
        return {}
    if world_size % tensor_parallel_size:
        raise ValueError(
            f"rollout.tensor_parallel_size ({tensor_parallel_size}) must divide the number of ranks ({world_size})"
        )
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tensor_parallel_size}


def generate_in_group(generate, prompts: list[Prompt], sampling: SamplingSettings) -> list[Completion]:
    """Run `generate` on the prompts of this rank's whole tensor-parallel group; keep this rank's share.

    Prompt i of a call is sampled with seed `sampling.seed + i`; the ranks of a group pass seeds
    that continue each other (rank r: base + r * prompts per rank), so the group's first seed gives
    every prompt the seed it would get from an engine of its own.
    """
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    shares: list = [None] * group.world_size
    dist.all_gather_object(shares, (prompts, sampling.seed), group=group.cpu_group)
    offset = sum(len(share) for share, _ in shares[: group.rank_in_group])
    completions = generate([p for share, _ in shares for p in share], dataclasses.replace(sampling, seed=shares[0][1]))
    return [
        dataclasses.replace(c, prompt_index=c.prompt_index - offset)
        for c in completions
        if offset <= c.prompt_index < offset + len(prompts)
    ]
