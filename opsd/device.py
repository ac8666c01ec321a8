"""Where this process runs: its device, and its rank among torchrun's processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class DeviceError(ValueError):
    """`train.device` names a device this machine does not have (the CLIs print it as one `error:` line)."""


def resolve_device(name: str) -> torch.device:
    """`train.device` as a device; `auto` is CUDA where there is one. On CUDA under torchrun, a
    machine with fewer GPUs than ranks on it is a `DeviceError` (one rank per GPU), raised before any
    rank asks for a device that does not exist."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("train.device is 'cuda' but no CUDA device is available: set train.device=auto or cpu")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "cuda" and local_ranks > torch.cuda.device_count():
        raise DeviceError(
            f"train.device is 'cuda' and torchrun started {local_ranks} ranks on this machine, which has "
            f"{torch.cuda.device_count()} CUDA device(s) visible: one rank per GPU (--nproc-per-node "
            f"{torch.cuda.device_count()}), or train.device=cpu"
        )
    return torch.device(name)


def process_rank() -> int:
    """This process's rank: the process group's once it exists, torchrun's `RANK` before, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def process_world_size() -> int:
    """The number of ranks: the process group's once it exists, torchrun's `WORLD_SIZE` before, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
