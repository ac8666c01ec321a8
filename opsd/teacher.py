"""The privileged teacher: which weights score the teacher prompts, one small class per `teacher.mode`.

    self   the live student weights
    ema    an EMA of the student: a frozen copy moved toward it after every step (with LoRA: a
           second adapter of the student, no model copy)
    fixed  a frozen copy of the initial weights
    base   the initial weights: with LoRA the student with its adapter switched off (no copy);
           without LoRA the same as `fixed`
    model  another model (`teacher.path`) with the student's tokenizer: loaded once, frozen, its own
           FSDP unit under torchrun; checked against the student before any weights load
           (`check_compatible`), never trained, synced or saved (a checkpoint records its path and
           fingerprint)

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
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from opsd import lora
from opsd.config import ConfigError, ModelConfig, TeacherConfig
from opsd.prompts import is_multimodal, tokenizer_of
from opsd.scoring import check_scoring_matches_forward, completion_logits

FrozenCopy = Callable[[nn.Module], nn.Module]
"""Makes a frozen copy of the student (plain `deepcopy`, or shard by shard under torchrun)."""
TeacherLoader = Callable[[TeacherConfig], nn.Module]
"""Loads a model teacher, frozen (in one process on the student's device, or sharded under torchrun)."""

# Where a checkpoint keeps the teacher's weights (`SAVED_WEIGHTS`), for offline dumps and export.
STUDENT_WEIGHTS = "student"
"""The student's own weights (`model/`) are the teacher's."""
TEACHER_DIR_WEIGHTS = "teacher_dir"
"""The teacher's own model directory, `teacher/` (an EMA: `opsd.export --ema` exports it)."""
INITIAL_WEIGHTS = "initial"
"""The run's initial weights (its `model.path`); the checkpoint holds no model directory of them."""
TEACHER_PATH_WEIGHTS = "teacher_path"
"""A model of its own, `teacher.path`, recorded in the checkpoint's manifest (`identity`), not copied."""


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
    model_bytes: float = 0.0
    """A model teacher's weights on this rank, in `teacher.dtype` (0 for the other modes)."""
    model_dtype: str = "float32"
    """`teacher.dtype`."""


class Teacher(Protocol):
    """What every teacher mode offers (the classes below implement it)."""

    SAVED_WEIGHTS: ClassVar[str]
    """STUDENT_WEIGHTS, TEACHER_DIR_WEIGHTS or INITIAL_WEIGHTS."""
    HOLDS_COPY: ClassVar[bool]
    """It holds a model of its own (a second FSDP root unit gathered while scoring)."""
    ADDS_EMA_ADAPTER: ClassVar[bool]
    """A LoRA student needs the frozen `ema` adapter beside its own (`lora.add_lora(ema=True)`)."""
    LOADS_MODEL: ClassVar[bool]
    """It is a model of its own read from `teacher.path` (built with a `TeacherLoader`, not a copy)."""
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

    def identity(self) -> dict | None:
        """What a checkpoint's manifest records of a teacher it holds no weights of (`path`,
        `fingerprint`), and a resume must find again; None: nothing."""

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

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER, LOADS_MODEL = STUDENT_WEIGHTS, False, False, False

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

    def identity(self):
        return None

    @staticmethod
    def memory_row(memory):
        return 0.0, "the student's own weights"


class FixedTeacher:
    """`fixed` (and `base` without LoRA): a frozen copy of the initial weights. Its tensors are in the
    checkpoint's train state (a resume needs them), not in a model directory: they are `model.path`'s."""

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER, LOADS_MODEL = INITIAL_WEIGHTS, True, False, False

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

    def identity(self):
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

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER, LOADS_MODEL = TEACHER_DIR_WEIGHTS, False, True, False

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

    def identity(self):
        return None

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


class VocabView:
    """A teacher whose LM head has more rows than the student's (vocabularies padded to another
    size, e.g. 152,064 vs 151,936): its logits cut to the student's rows, the shared vocabulary
    (`check_compatible` made sure the tokens there are the same). Scores where a model does."""

    def __init__(self, teacher: nn.Module, rows: int):
        self.teacher, self.rows = teacher, rows
        self.config = teacher.config

    def opsd_completion_logits(self, batch) -> torch.Tensor:
        return completion_logits(self.teacher, batch)[:, : self.rows]

    def parameters(self):
        return self.teacher.parameters()


def head_rows(model: nn.Module) -> int:
    """Rows of the LM head: the ids a model can sample or score (its global shape when sharded)."""
    return model.get_output_embeddings().weight.shape[0]


class ModelTeacher(SelfTeacher):
    """`model`: another model read from `teacher.path` (a larger one of the student's family, or the
    student trained elsewhere), frozen and in eval mode; it scores the teacher prompts built as for
    every mode (`prompts.privileged: []` is classic on-policy distillation). Nothing of it trains,
    moves, reaches the engine or goes into a checkpoint but its path and fingerprint (`identity`):
    `self`'s nothing to update, save or restart, with a model of its own."""

    SAVED_WEIGHTS, HOLDS_COPY, ADDS_EMA_ADAPTER, LOADS_MODEL = TEACHER_PATH_WEIGHTS, False, False, True

    def __init__(self, cfg: TeacherConfig, student: nn.Module, load_model: TeacherLoader):
        self.mode, self.path = cfg.mode, cfg.path
        self.module = load_model(cfg)
        rows, student_rows = head_rows(self.module), head_rows(student)
        if rows < student_rows:  # check_compatible refuses this from the configs; a loader may differ
            raise ConfigError(f"teacher.path {cfg.path}: its LM head has {rows} rows, fewer than the student's "
                              f"{student_rows}: it cannot score every token the student samples")
        self.scorer = VocabView(self.module, student_rows) if rows > student_rows else self.module
        self.fingerprint = model_dir_fingerprint(cfg.path)

    def identity(self):
        return {"path": self.path, "fingerprint": self.fingerprint}

    @staticmethod
    def memory_row(memory):
        if memory.offloaded:
            return 0.0, "shards offloaded to host memory"
        return memory.model_bytes, f"{memory.model_dtype} {memory.per}, its own model (frozen)"


TEACHERS: dict[str, type[Teacher]] = {"self": SelfTeacher, "ema": EmaTeacher, "fixed": FixedTeacher, "base": FixedTeacher,
                                      "model": ModelTeacher}
"""`teacher.mode` -> its class. Without LoRA, `base` means `fixed`: the initial weights are a frozen copy."""
LORA_TEACHERS: dict[str, type[Teacher]] = {"ema": EmaAdapterTeacher, "base": BaseAdapterTeacher}
"""The modes whose LoRA student keeps the teacher as an adapter (or none) instead of a model copy."""


def teacher_class(cfg: TeacherConfig, lora_student: bool) -> type[Teacher]:
    """The class of `cfg.mode` for a LoRA student (`lora_student`) or a full-weight one."""
    return (LORA_TEACHERS.get(cfg.mode) if lora_student else None) or TEACHERS[cfg.mode]


def make_teacher(cfg: TeacherConfig, student: nn.Module, copy_student: FrozenCopy = frozen_copy,
                 load_model: TeacherLoader | None = None) -> Teacher:
    """The run's teacher for `student` (a LoRA student: after `add_lora`); `copy_student` makes the
    frozen copy a mode may need, `load_model` the model a `LOADS_MODEL` mode reads (default: in one
    process, on the student's device)."""
    cls = teacher_class(cfg, lora.is_lora(student))
    if cls.LOADS_MODEL:
        device = next(student.parameters()).device
        return cls(cfg, student, load_model or teacher_loader(ModelConfig(path=cfg.path), None, device))
    return cls(cfg, student, copy_student)


def check_teacher(cfg: TeacherConfig, model_cfg: ModelConfig, student_processor) -> None:
    """Before any weights load: a mode that `LOADS_MODEL` must share the student's tokenizer and
    inputs (`check_compatible`); nothing to check for the others."""
    if teacher_class(cfg, model_cfg.lora is not None).LOADS_MODEL:
        check_compatible(student_processor, model_cfg, cfg)


def teacher_loader(model_cfg: ModelConfig, processor, device: torch.device) -> TeacherLoader:
    """Loads a model teacher in one process: built first when `teacher.build` asks, in `teacher.dtype`,
    frozen; refused when scoring would not reproduce its forward. `model_cfg` (the student's) gives the
    remote-code and attention settings, `processor` (the student's: the teacher's is the same) the
    model class; None: the teacher's own."""
    from opsd.modeling import load_frozen_model, load_processor, prepare_model_dir, teacher_model_config

    def load(cfg: TeacherConfig) -> nn.Module:
        teacher_cfg = teacher_model_config(model_cfg, cfg)
        prepare_model_dir(teacher_cfg)
        model = load_frozen_model(teacher_cfg, processor or load_processor(teacher_cfg), device, cfg.dtype)
        check_scoring_matches_forward(model)
        return model

    return load


def saved_weights(mode: str) -> str:
    """Where a checkpoint written with `teacher.mode=mode` keeps the teacher's weights (SAVED_WEIGHTS)."""
    if mode not in TEACHERS:
        raise ValueError(f"teacher.mode={mode} is not a mode this opsd knows ({', '.join(TEACHERS)})")
    return TEACHERS[mode].SAVED_WEIGHTS


def resume_refusal(teacher: Teacher, saved_mode: str, saved_identity: dict | None = None) -> str | None:
    """Why a checkpoint written with `teacher.mode=saved_mode` (and a teacher of `saved_identity`, the
    manifest's record of a model teacher) cannot restore `teacher` (None: it can)."""
    if saved_mode != teacher.mode:
        return f"it was written with teacher.mode={saved_mode}, this run has teacher.mode={teacher.mode}"
    identity = teacher.identity()
    if identity is not None and (saved_identity or {}).get("fingerprint") != identity["fingerprint"]:
        saved = saved_identity or {}
        return (f"it was written with the teacher at teacher.path={saved.get('path')} (fingerprint "
                f"{str(saved.get('fingerprint'))[:12]}), this run's teacher.path={identity['path']} has fingerprint "
                f"{identity['fingerprint'][:12]}: resume with the run's own teacher (teacher.path={saved.get('path')}), "
                "or start a new run (another logging.output_dir) from this checkpoint's student with "
                "checkpoint.resume_model_only=true")
    return None


# --- a model teacher against the student, before any weights load ------------------------------

FINGERPRINT_EDGE_BYTES = 1 << 20
"""A weight file's fingerprint reads its size and its first and last MiB (the safetensors header, whose
offsets and shapes name every tensor, and the last tensors' bytes), not all of it."""


def model_dir_fingerprint(path: str) -> str:
    """sha256 over a model directory's config.json and its weight files (name, size, first and last
    MiB): another model, other weights or another dtype give another fingerprint, without reading
    tens of GB. A hub id: its snapshot in the local cache (where loading it put it)."""
    root = Path(path)
    if not (root / "config.json").is_file():
        from transformers.utils import cached_file

        root = Path(cached_file(path, "config.json")).parent
    digest = hashlib.sha256((root / "config.json").read_bytes())
    weights = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file())
    for file in weights:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_EDGE_BYTES))
            f.seek(max(0, size - FINGERPRINT_EDGE_BYTES))
            digest.update(f.read())
    return digest.hexdigest()


def _first_difference(name: str, student, teacher) -> str | None:
    if student == teacher:
        return None
    if isinstance(student, dict) and isinstance(teacher, dict):
        for key in sorted(set(student) | set(teacher), key=str):
            if student.get(key) != teacher.get(key):
                return _first_difference(f"{name}[{key!r}]", student.get(key), teacher.get(key))
    if isinstance(student, str) and isinstance(teacher, str) and len(student) > 40:
        at = next((i for i, (a, b) in enumerate(zip(student, teacher)) if a != b), min(len(student), len(teacher)))
        return f"{name} (first at character {at}: student {student[at:at + 20]!r}, teacher {teacher[at:at + 20]!r})"
    return f"{name} (student {student!r}, teacher {teacher!r})"


def _vocabulary_difference(student_tok, teacher_tok) -> str | None:
    student, teacher = student_tok.get_vocab(), teacher_tok.get_vocab()
    if student == teacher:
        return None
    for token, index in sorted(student.items(), key=lambda item: item[1]):
        if teacher.get(token) != index:
            where = "not in the teacher's" if token not in teacher else f"id {teacher[token]} in the teacher's"
            return f"token {token!r} (id {index} in the student's tokenizer) is {where}"
    token, index = min(((t, i) for t, i in teacher.items() if t not in student), key=lambda item: item[1])
    return f"token {token!r} (id {index} in the teacher's tokenizer) is not in the student's"


SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "pad_token")


def compatibility_difference(student_processor, teacher_processor, student_config, teacher_config) -> str | None:
    """The first thing in which a teacher cannot score the student's sequences: the kind of model,
    a token of the vocabulary, a special token, the chat template, the LM head's rows, the image
    processor or the image tokens (None: none). Reads processors and configs, no weights."""
    if is_multimodal(student_processor) != is_multimodal(teacher_processor):
        kinds = {True: "a vision-language model", False: "a text model"}
        return (f"the teacher is {kinds[is_multimodal(teacher_processor)]}, the student "
                f"{kinds[is_multimodal(student_processor)]}")
    student_tok, teacher_tok = tokenizer_of(student_processor), tokenizer_of(teacher_processor)
    differs = _vocabulary_difference(student_tok, teacher_tok)
    for name in SPECIAL_TOKEN_ATTRIBUTES:
        differs = differs or _first_difference(f"special token {name}", getattr(student_tok, name), getattr(teacher_tok, name))
    differs = differs or _first_difference("special tokens", sorted(student_tok.all_special_tokens),
                                           sorted(teacher_tok.all_special_tokens))
    differs = differs or _first_difference("chat template", _chat_template(student_processor), _chat_template(teacher_processor))
    if differs:
        return differs
    student_rows, teacher_rows = (c.get_text_config().vocab_size for c in (student_config, teacher_config))
    if teacher_rows < student_rows:
        return (f"the teacher's LM head has {teacher_rows} rows, fewer than the student's {student_rows} "
                "(a teacher with more rows is scored over the student's)")
    if is_multimodal(student_processor):
        differs = _first_difference("processor setting", _image_settings(student_processor), _image_settings(teacher_processor))
        differs = differs or _first_difference("model config", _image_token_ids(student_config), _image_token_ids(teacher_config))
    return differs


def _chat_template(processor):
    return getattr(processor, "chat_template", None) or tokenizer_of(processor).chat_template


def _image_settings(processor) -> dict:
    """The processor's settings that decide a sample's image inputs (image processor, tokens per image)."""
    settings = processor.to_dict()
    settings.pop("chat_template", None)
    return json.loads(json.dumps(settings, default=str))


def _image_token_ids(config) -> dict:
    return {key: value for key, value in config.to_dict().items()
            if key.endswith("_token_id") and any(word in key for word in ("image", "vision", "video"))}


def check_compatible(student_processor, model_cfg: ModelConfig, teacher_cfg: TeacherConfig) -> None:
    """Stop with one line (a `ConfigError`) when the model teacher of `teacher_cfg` cannot score the
    student's sequences token for token; builds a `teacher.build` teacher first. Reads the teacher's
    tokenizer, processor and config.json only: it runs before any weights load."""
    from transformers import AutoConfig

    from opsd.modeling import load_processor, prepare_model_dir, teacher_model_config

    teacher_model = teacher_model_config(model_cfg, teacher_cfg)
    prepare_model_dir(teacher_model)
    try:
        teacher_processor = load_processor(teacher_model)
    except ConfigError as err:
        raise ConfigError(f"teacher.path: {err}".replace("model.path", "the teacher's path")) from None
    configs = [AutoConfig.from_pretrained(c.path, trust_remote_code=c.trust_remote_code) for c in (model_cfg, teacher_model)]
    differs = compatibility_difference(student_processor, teacher_processor, *configs)
    if differs:
        raise ConfigError(f"teacher.path {teacher_cfg.path} does not share the student's tokenizer and inputs: {differs}; "
                          "cross-tokenizer distillation is not supported")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
