"""The privileged teacher: which weights score the teacher prompts, one small class per `teacher.mode`.

    self   the live student weights
    ema    an EMA of the student: a frozen copy moved toward it after every step (with LoRA: a
           second adapter of the student, no model copy)
    fixed  a frozen copy of the initial weights
    base   the initial weights: with LoRA the student with its adapter switched off (no copy);
           without LoRA the same as `fixed`

`make_teacher` builds one from `TeacherConfig` once per run. Each class owns what its mode means
everywhere: the model that scores (`scorer`), its update after an optimizer step (`update`), its
share of a checkpoint (`train_state` / `load_train_state`, the `teacher/` model directory of
`model_dir`, `restart_from` for a weights-only start), where a saved run keeps its weights
(`SAVED_WEIGHTS`, for offline dumps and export) and its row of the memory plan (`memory_row`).
Nothing else in opsd compares `teacher.mode`. A new mode: a class with this interface here, an entry
in `TEACHERS`, and its name in `TEACHER_MODES` (opsd/config.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from opsd import lora
from opsd.config import TeacherConfig
from opsd.scoring import completion_logits

FrozenCopy = Callable[[nn.Module], nn.Module]
"""Makes a frozen copy of the student (plain `deepcopy`, or shard by shard under torchrun)."""

# Where a checkpoint keeps the teacher's weights (`SAVED_WEIGHTS`), for offline dumps and export.
STUDENT_WEIGHTS = "student"
"""The student's own weights (`model/`) are the teacher's."""
TEACHER_DIR_WEIGHTS = "teacher_dir"
"""The teacher's own model directory, `teacher/` (an EMA: `opsd.export --ema` exports it)."""
INITIAL_WEIGHTS = "initial"
"""The run's initial weights (its `model.path`); the checkpoint holds no model directory of them."""


@dataclass(frozen=True)
class TeacherMemory:
    """What the memory plan knows about one rank, in the terms a teacher's row needs."""

    copy_bytes: float
    """A frozen float32 copy of the model on this rank."""
    adapter_bytes: float
    """One more float32 LoRA adapter on this rank."""
    per: str
    """How a copy is split over ranks, e.g. `/ 2 ranks` or `(unsharded)`."""
    offloaded: bool
    """A frozen copy's shards live in host memory (`distributed.cpu_offload_teacher` under torchrun)."""
    shared: str = ""
    """What a copy shares with the student instead of copying (a frozen vision tower in one process,
    left out of `copy_bytes`); empty: nothing."""


class Teacher(Protocol):
    """What every teacher mode offers (the classes below implement it)."""

    SAVED_WEIGHTS: ClassVar[str]
    """STUDENT_WEIGHTS, TEACHER_DIR_WEIGHTS or INITIAL_WEIGHTS."""
    HOLDS_COPY: ClassVar[bool]
    """It holds a model of its own (a second FSDP root unit gathered while scoring)."""
    ADDS_EMA_ADAPTER: ClassVar[bool]
    """A LoRA student needs the frozen `ema` adapter beside its own (`lora.add_lora(ema=True)`)."""
    mode: str
    """The configured name (written into checkpoints' manifests)."""
    scorer: object
    """What scores the teacher prompts: a model, or an `AdapterView` of the student."""
    module: nn.Module | None
    """The teacher's own model (None: it scores with the student's weights)."""

    def update(self, student: nn.Module) -> None:
        """After every optimizer step (the skipped ones included)."""

    def train_state(self) -> dict | None:
        """Tensors the checkpoint's train state holds under `teacher` (None: nothing)."""

    def load_train_state(self, state: dict) -> None:
        """Take the tensors `train_state` described, as loaded from a checkpoint."""

    def restart_from(self, student: nn.Module) -> None:
        """A run started from a checkpoint's weights alone: the teacher starts from them too."""

    def model_dir(self, student: nn.Module) -> tuple[nn.Module, str] | None:
        """(module, adapter) a checkpoint writes as `teacher/` (None: no such directory)."""

    @staticmethod
    def memory_row(memory: TeacherMemory) -> tuple[float, str]:
        """(bytes on one rank, how they were counted) for the memory plan."""


class AdapterView:
    """The LoRA student scoring with another adapter switched in (`ema`) or with none (`None`: base).

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


def frozen_copy(student: nn.Module) -> nn.Module:
    """A copy of the student that does not train (one process). A frozen part of a full-weight
    student (`model.freeze_vision`) is the same in both and is shared, not copied: deepcopy takes the
    memo's parameters as they are."""
    frozen = {} if lora.is_lora(student) else {id(p): p for p in student.parameters() if not p.requires_grad}
    return copy.deepcopy(student, memo=frozen).eval().requires_grad_(False)


def _copy_row(memory: TeacherMemory) -> tuple[float, str]:
    if memory.offloaded:
        return 0.0, "shards offloaded to host memory"
    return memory.copy_bytes, f"float32 {memory.per}" + (f", {memory.shared} shared with the student" if memory.shared else "")


class SelfTeacher:
    """`self`: the live student scores the teacher prompts; nothing to copy, update or save."""

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER = STUDENT_WEIGHTS, False, False

    def __init__(self, cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy):
        self.mode, self.scorer, self.module = cfg.mode, student, None

    def update(self, student):
        pass

    def train_state(self):
        return None

    def load_train_state(self, state):
        pass

    def restart_from(self, student):
        pass

    def model_dir(self, student):
        return None

    @staticmethod
    def memory_row(memory):
        return 0.0, "the student's own weights"


class FixedTeacher:
    """`fixed` (and `base` without LoRA): a frozen copy of the initial weights. Its tensors are in the
    checkpoint's train state (a resume needs them), not in a model directory: they are `model.path`'s."""

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER = INITIAL_WEIGHTS, True, False

    def __init__(self, cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy):
        self.mode = cfg.mode
        self.module = self.scorer = copy_student(student)

    def update(self, student):
        pass

    def train_state(self):
        return get_model_state_dict(self.module)

    def load_train_state(self, state):
        set_model_state_dict(self.module, state)

    def restart_from(self, student):
        set_model_state_dict(self.module, get_model_state_dict(student))

    def model_dir(self, student):
        return None

    memory_row = staticmethod(_copy_row)


class EmaTeacher(FixedTeacher):
    """`ema` of full weights: a frozen copy that moves toward the student after every step,
    teacher = decay * teacher + (1 - decay) * student, shard by shard when sharded."""

    SAVED_WEIGHTS = TEACHER_DIR_WEIGHTS

    def __init__(self, cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy):
        super().__init__(cfg, student, copy_student)
        self.decay = cfg.ema_decay

    @torch.no_grad()
    def update(self, student):
        # Sharded (FSDP) models are updated shard by shard: both are sharded alike, so local shards
        # correspond; a CPU-offloaded teacher's shards take the student's over to the CPU. A frozen
        # student weight (`model.freeze_vision`) is its own EMA: shared, or an unchanged copy when sharded.
        pairs = [(t, s) for t, s in zip(self.module.parameters(), student.parameters(), strict=True) if s.requires_grad]
        teacher_params = [local_tensor(t) for t, _ in pairs]
        student_params = [local_tensor(s.detach()).to(t.device) for (_, s), t in zip(pairs, teacher_params)]
        torch._foreach_lerp_(teacher_params, student_params, 1.0 - self.decay)

    def model_dir(self, student):
        return self.module, lora.STUDENT_ADAPTER


class EmaAdapterTeacher:
    """`ema` of a LoRA student: a second, frozen adapter (`ema`) of the student moves toward its
    adapter after every step; the teacher is the student with that adapter switched in."""

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER = TEACHER_DIR_WEIGHTS, False, True

    def __init__(self, cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy):
        self.mode, self.decay, self.student, self.module = cfg.mode, cfg.ema_decay, student, None
        self.scorer = AdapterView(student, lora.EMA_ADAPTER)

    @torch.no_grad()
    def update(self, student):
        teacher_params = lora.adapter_parameters(student, lora.EMA_ADAPTER)
        student_params = lora.adapter_parameters(student)
        teacher_params = [local_tensor(teacher_params[name]) for name in student_params]
        student_params = [local_tensor(p.detach()) for p in student_params.values()]
        torch._foreach_lerp_(teacher_params, student_params, 1.0 - self.decay)

    def train_state(self):
        # The EMA adapter's own tensors under the student adapter's names: loaded in place.
        return {k: p.detach() for k, p in lora.adapter_parameters(self.student, lora.EMA_ADAPTER).items()}

    def load_train_state(self, state):
        pass  # `train_state` handed out the parameters themselves: loading wrote into them

    def restart_from(self, student):
        lora.reset_ema_adapter(student)

    def model_dir(self, student):
        return student, lora.EMA_ADAPTER

    @staticmethod
    def memory_row(memory):
        return memory.adapter_bytes, "a second adapter"


class BaseAdapterTeacher(SelfTeacher):
    """`base` of a LoRA student: the student with its adapter switched off, the initial weights."""

    SAVED_WEIGHTS = INITIAL_WEIGHTS

    def __init__(self, cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy):
        super().__init__(cfg, student, copy_student)
        self.scorer = AdapterView(student, None)

    @staticmethod
    def memory_row(memory):
        return 0.0, "the student's own weights, adapter switched off"


TEACHERS: dict[str, type[Teacher]] = {"self": SelfTeacher, "ema": EmaTeacher, "fixed": FixedTeacher, "base": FixedTeacher}
"""`teacher.mode` -> its class. Without LoRA, `base` means `fixed`: the initial weights are a frozen copy."""
LORA_TEACHERS: dict[str, type[Teacher]] = {"ema": EmaAdapterTeacher, "base": BaseAdapterTeacher}
"""The modes whose LoRA student keeps the teacher as an adapter (or none) instead of a model copy."""


def teacher_class(cfg: TeacherConfig, lora_student: bool) -> type[Teacher]:
    """The class of `cfg.mode` for a LoRA student (`lora_student`) or a full-weight one."""
    return (LORA_TEACHERS.get(cfg.mode) if lora_student else None) or TEACHERS[cfg.mode]


def make_teacher(cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy) -> Teacher:
    """The run's teacher for `student` (a LoRA student: after `add_lora`); `copy_student` makes the
    frozen copy a mode may need."""
    return teacher_class(cfg, lora.is_lora(student))(cfg, student, copy_student)


def saved_weights(mode: str) -> str:
    """Where a checkpoint written with `teacher.mode=mode` keeps the teacher's weights (SAVED_WEIGHTS)."""
    if mode not in TEACHERS:
        raise ValueError(f"teacher.mode={mode} is not a mode this opsd knows ({', '.join(TEACHERS)})")
    return TEACHERS[mode].SAVED_WEIGHTS


def resume_refusal(teacher: Teacher, saved_mode: str) -> str | None:
    """Why a checkpoint written with `teacher.mode=saved_mode` cannot restore `teacher` (None: it can)."""
    if saved_mode != teacher.mode:
        return f"it was written with teacher.mode={saved_mode}, this run has teacher.mode={teacher.mode}"
    return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
