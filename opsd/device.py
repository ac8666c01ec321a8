"""Where this process runs: its device, and its rank among torchrun's processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available")
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
