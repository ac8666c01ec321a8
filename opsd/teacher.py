"""The privileged teacher: the live student (`self`), an EMA of it (`ema`), a frozen copy (`fixed`), or
the initial weights (`base`). With LoRA, `base` and `ema` are adapters of the student, not copies."""

from __future__ import annotations

import copy

import torch
from torch import nn

from opsd import lora
from opsd.config import TeacherConfig
from opsd.scoring import completion_logits


class AdapterTeacher:
    """The LoRA student scoring with another adapter switched in (`ema`) or with none (`base`).

    Scoring dispatches to `opsd_completion_logits` (opsd/scoring.py), so it takes this object where it
    takes a model; the weights are the student's, nothing is copied.
    """

    def __init__(self, student: nn.Module, adapter: str | None):
        self.student, self.adapter = student, adapter
        self.config = student.config

    def opsd_completion_logits(self, batch) -> torch.Tensor:
        with lora.active_adapter(self.student, self.adapter):
            return completion_logits(self.student, batch)

    def parameters(self):
        return self.student.parameters()


def make_teacher(cfg: TeacherConfig, student: nn.Module):
    """What scores teacher prompts; `self` is the student itself."""
    if cfg.mode == "self":
        return student
    if lora.is_lora(student) and cfg.mode in ("base", "ema"):
        return AdapterTeacher(student, None if cfg.mode == "base" else lora.EMA_ADAPTER)
    # `fixed`, and `base` without LoRA: the initial weights. A frozen part (`model.freeze_vision`) is
    # the same in both and is shared, not copied: deepcopy takes the memo's parameters as they are.
    frozen = {} if lora.is_lora(student) else {id(p): p for p in student.parameters() if not p.requires_grad}
    teacher = copy.deepcopy(student, memo=frozen)
    return teacher.eval().requires_grad_(False)


def module_of(teacher, student: nn.Module) -> nn.Module:
    """The module holding the teacher's weights: the student itself for adapter teachers."""
    return student if isinstance(teacher, AdapterTeacher) else teacher


@torch.no_grad()
def update_teacher(cfg: TeacherConfig, teacher, student: nn.Module) -> None:
    """After each optimizer step: EMA teachers move toward the student; the others stay."""
    if cfg.mode != "ema":
        return
    if isinstance(teacher, AdapterTeacher):  # the EMA adapter toward the student's adapter
        teacher_params = lora.adapter_parameters(student, lora.EMA_ADAPTER)
        student_params = lora.adapter_parameters(student)
        teacher_params = [local_tensor(teacher_params[name]) for name in student_params]
        student_params = [local_tensor(p.detach()) for p in student_params.values()]
    else:
        # Sharded (FSDP) models are updated shard by shard: both are sharded alike, so local shards
        # correspond; a CPU-offloaded teacher's shards take the student's over to the CPU. A frozen
        # student weight (`model.freeze_vision`) is its own EMA: shared, or an unchanged copy when sharded.
        pairs = [(t, s) for t, s in zip(teacher.parameters(), student.parameters(), strict=True) if s.requires_grad]
        teacher_params = [local_tensor(t) for t, _ in pairs]
        student_params = [local_tensor(s.detach()).to(t.device) for (_, s), t in zip(pairs, teacher_params)]
    torch._foreach_lerp_(teacher_params, student_params, 1.0 - cfg.ema_decay)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
