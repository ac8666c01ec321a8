"""The privileged teacher: the live student (`self`), an EMA of it (`ema`) or a frozen copy (`fixed`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from opsd.config import TeacherConfig


def make_teacher(cfg: TeacherConfig, student: nn.Module) -> nn.Module:
    """The module that scores teacher prompts; `self` shares the student's weights."""
    if cfg.mode == "self":
        return student
    teacher = copy.deepcopy(student)
    return teacher.eval().requires_grad_(False)


@torch.no_grad()
def update_teacher(cfg: TeacherConfig, teacher: nn.Module, student: nn.Module) -> None:
    """After each optimizer step: EMA teachers move toward the student; the others stay."""
    if cfg.mode != "ema":
        return
    # Sharded (FSDP) models are updated shard by shard: both are sharded alike, so local shards
    # correspond; a CPU-offloaded teacher's shards take the student's over to the CPU.
    teacher_params = [local_tensor(p) for p in teacher.parameters()]
    student_params = [local_tensor(p.detach()).to(t.device) for p, t in zip(student.parameters(), teacher_params)]
    torch._foreach_lerp_(teacher_params, student_params, 1.0 - cfg.ema_decay)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
