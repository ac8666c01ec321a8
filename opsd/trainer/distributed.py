"""Ranks under torchrun: process group, device mesh, and the few collectives the recipe needs.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
Without it (a plain `python -m opsd.train`) it returns a single-process context whose collectives
return their input, so the recipe has one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from opsd.config import DistributedConfig
from opsd.device import process_rank, process_world_size, resolve_device
from opsd.trainer.heartbeat import Heartbeat


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None
    """FSDP mesh: 1-D (shard) or 2-D (replicate, shard); None in a single process."""
    heartbeat: Heartbeat | None = field(default=None, compare=False)
    """Watches another rank (see opsd/trainer/heartbeat.py); None in a single process or when off."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def gather(self, value: float) -> list[float]:
        """`value` of every rank, in rank order."""
        if not self.enabled:
            return [value]
        out = torch.zeros(self.world_size, dtype=torch.float64, device=self._comm_device)
        dist.all_gather_into_tensor(out, torch.tensor([value], dtype=torch.float64, device=self._comm_device))
        return out.tolist()

    def barrier(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.barrier()

    def stop_heartbeat(self) -> None:
        """This rank is done, finished or failed: its watcher stops waiting for it."""
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def close(self) -> None:
        self.stop_heartbeat()
        # An in-process vLLM engine tears the process group down in its own shutdown.
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return process_world_size() > 1


def init_distributed(cfg: DistributedConfig, device_name: str) -> Ranks:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA) and build the FSDP mesh."""
    if not launched_by_torchrun():
        return Ranks(device=resolve_device(device_name))
    rank, world_size = process_rank(), process_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    mesh = build_mesh(cfg, device, world_size)
    heartbeat = Heartbeat(rank, world_size, cfg.heartbeat_timeout_s) if cfg.heartbeat_timeout_s else None
    return Ranks(rank, world_size, local_rank, device, mesh, heartbeat)


def build_mesh(cfg: DistributedConfig, device: torch.device, world_size: int) -> DeviceMesh:
    shard = cfg.shard_size or world_size
    if world_size % shard:
        raise ValueError(f"distributed.shard_size ({shard}) must divide the number of ranks ({world_size})")
    if shard == world_size:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    # Hybrid sharding: FSDP inside each group of `shard` ranks, replicas across groups.
    return init_device_mesh(device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
