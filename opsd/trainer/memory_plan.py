"""Memory plan: what one rank of a run holds on its accelerator, estimated before any weight is loaded.

`--dry-run` prints it for the resolved config and a world size. The parameter counts are exact: the
model is built from its config on the meta device (no weights read, nothing allocated). The rest is
arithmetic on those counts and the config (dtypes, sharding, teacher, engine, token budget);
activations and the engine's runtime are estimates, said so in the output.

Per rank, with P parameters sharded over S ranks (FSDP: all ranks; HSDP: `distributed.shard_size`):
- student master weights, gradients (reduce-scattered every micro-step, so sharded), AdamW's two
  states: 4 + 4 + 8 bytes x P / S; an `ema`/`fixed` teacher another 4 x P / S (0 when offloaded);
  a model teacher (`teacher.mode: model`) its own T parameters x `teacher.dtype` bytes / S;
- gathered FSDP units while computing: the root unit (embeddings, LM head, vision stem) of the
  student and of the teacher, plus two blocks (one computing, one prefetched; the larger model's),
  in `param_dtype` (a bfloat16 model teacher's in bfloat16); a model teacher's forward also holds
  one of its blocks' working set;
- activations of one micro-step at `max_forward_tokens` per sequence (block inputs kept under
  activation checkpointing plus one block recomputed, or every block's), the vision tower's for the
  problem images, and the completion logits of both roles;
- the colocated engine: awake while sampling (weights + KV cache, or `gpu_memory_utilization` of the
  device when the KV cache is unbounded), nearly nothing while training when it sleeps.
The peak is the larger of the rollout phase (engine awake) and the training phase (engine asleep).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opsd.config import Config, LoraConfig, ModelConfig
from opsd.loss_kinds import build_loss
from opsd.teacher import TeacherMemory, teacher_class

GB = 1e9
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"
"""config.json of hub models the shipped recipes use (`<org>--<name>.json`): a dry run never downloads."""
CONTEXT_GB = 1.5
"""CUDA context, NCCL buffers and allocator slack per process (an estimate)."""
ENGINE_ASLEEP_GB = 1.0
"""What a sleeping vLLM engine keeps (CUDA graphs, allocator pools; an estimate)."""
ENGINE_RUNTIME_GB = 2.0
"""A vLLM engine's activations and CUDA graphs besides weights and KV cache (an estimate)."""
HEADROOM = 0.9
"""The plan fits when its peak stays under this fraction of the device (fragmentation, spikes)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def hf_config(model_cfg: ModelConfig):
    """The model's transformers config: its directory, the local hub cache, or a config shipped with opsd."""
    from transformers import AutoConfig

    path = Path(model_cfg.path)
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code), str(path / "config.json")
    try:
        config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True, trust_remote_code=model_cfg.trust_remote_code)
        return config, f"{model_cfg.path} (local hub cache)"
    except (OSError, ValueError):
        pass
    shipped = SHIPPED_CONFIGS / f"{model_cfg.path.replace('/', '--')}.json"
    if shipped.is_file():
        raw = json.loads(shipped.read_text())
        return AutoConfig.for_model(raw.pop("model_type"), **raw), f"{shipped.name} (shipped with opsd)"
    raise FileNotFoundError(
        f"model.path: no config.json for {model_cfg.path} (not a local directory, not in the hub cache, "
        f"not among {sorted(p.stem for p in SHIPPED_CONFIGS.glob('*.json'))})"
    )


@dataclass
class ModelShape:
    parameters: int
    root_parameters: int
    """Outside every transformer block: the FSDP root unit (embeddings, LM head, vision stem, norms)."""
    largest_block: int
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    vision: dict | None
    """Vision tower: layers, hidden, intermediate, patch, merge, image_size (None = text model)."""
    lora_parameters: int = 0
    """The adapter's parameters when `model.lora` is set (rank x (in + out) per adapted layer)."""
    vision_parameters: int = 0
    """The vision tower's and connector's (`modeling.vision_parameter_names`), what `model.freeze_vision` freezes."""


def meta_model(config, multimodal: bool) -> torch.nn.Module:
    """The model built from `config` on the meta device: exact shapes, no memory, no weights read."""
    from opsd.modeling import model_class

    with torch.device("meta"):
        return model_class(multimodal).from_config(config, dtype=torch.float32)


def model_shape(config, lora: LoraConfig | None = None) -> ModelShape:
    from opsd.modeling import vision_parameter_names
    from opsd.trainer.fsdp import transformer_blocks

    vision_cfg = getattr(config, "vision_config", None)
    model = meta_model(config, multimodal=vision_cfg is not None)
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in transformer_blocks(model)]
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    vision = None
    if vision_cfg is not None:
        vision = {
            "layers": getattr(vision_cfg, "depth", None) or vision_cfg.num_hidden_layers,
            "hidden": getattr(vision_cfg, "embed_dim", None) or vision_cfg.hidden_size,
            "intermediate": getattr(vision_cfg, "intermediate_size", None) or 4 * vision_cfg.hidden_size,
            "patch": vision_cfg.patch_size,
            "merge": getattr(vision_cfg, "spatial_merge_size", None) or getattr(config, "scale_factor", 1),
            "image_size": getattr(vision_cfg, "image_size", None),  # fixed-size encoders (Idefics3, SigLIP)
        }
    return ModelShape(
        parameters=total,
        root_parameters=total - sum(blocks),
        largest_block=max(blocks, default=0),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        kv_dim=2 * (getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        vocab=text.vocab_size,
        vision=vision,
        lora_parameters=lora_parameters(model, lora) if lora else 0,
        vision_parameters=sum(model.get_parameter(name).numel() for name in vision_parameter_names(model)),
    )


def lora_parameters(model: torch.nn.Module, lora: LoraConfig) -> int:
    """What `add_lora` would add: rank x (in + out) for every linear layer its target pattern names."""
    from opsd.lora import target_pattern

    pattern = re.compile(target_pattern(model, lora))
    return sum(
        lora.rank * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name)
    )


def _block_activations(tokens: int, layers: int, hidden: int, intermediate: int, kv_dim: int, nbytes: int, checkpointing: bool) -> float:
    """Bytes a transformer stack keeps for backward: each block's input under checkpointing (plus one
    block recomputed), else each block's working set (norms, q/k/v, attention out, gated MLP)."""
    per_block = tokens * (6 * hidden + kv_dim + 4 * intermediate) * nbytes
    if checkpointing:
        return layers * tokens * hidden * nbytes + per_block
    return layers * per_block


@dataclass
class MemoryPlan:
    world_size: int
    shard_size: int
    device_gb: float | None
    config_source: str
    shape: ModelShape
    rows: list[tuple[str, float, str]]
    """(item, GB per rank, how it was counted)."""
    rollout_gb: float
    training_gb: float
    hints: list[str] = field(default_factory=list)
    """Settings of this config that would lower the peak, named first when it does not fit."""

    @property
    def peak_gb(self) -> float:
        return max(self.rollout_gb, self.training_gb)

    @property
    def fits(self) -> bool | None:
        return None if self.device_gb is None else self.peak_gb <= HEADROOM * self.device_gb

    def describe(self) -> str:
        lines = [
            f"memory plan per rank: world size {self.world_size}, weights sharded over {self.shard_size} rank(s); "
            f"GB = 1e9 bytes",
            f"  model: {self.shape.parameters / 1e9:.3f}B parameters, from {self.config_source} (built on the meta device)",
        ]
        lines += [f"  {item:<28} {gb:8.2f} GB  {how}" for item, gb, how in self.rows]
        lines.append(f"  {'peak, rollout phase':<28} {self.rollout_gb:8.2f} GB  (engine awake, student and teacher resident)")
        lines.append(f"  {'peak, training phase':<28} {self.training_gb:8.2f} GB  (engine asleep or idle, activations)")
        if self.device_gb is None:
            lines.append("  device memory unknown: pass --gpu-memory-gb (no CUDA device detected)")
        elif self.fits:
            lines.append(
                f"  fits: peak {self.peak_gb:.1f} GB of {self.device_gb:.0f} GB "
                f"({self.device_gb - self.peak_gb:.1f} GB to spare; plan keeps {100 * (1 - HEADROOM):.0f}% headroom)"
            )
        else:
            over = self.peak_gb - HEADROOM * self.device_gb
            hints = "".join(f"{hint}; " for hint in self.hints)
            lines.append(
                f"  WARNING: DOES NOT FIT: peak {self.peak_gb:.1f} GB > {HEADROOM:.0%} of {self.device_gb:.0f} GB "
                f"(by {over:.1f} GB). {hints}More ranks (torchrun), distributed.activation_checkpointing, a smaller "
                "train.max_forward_tokens, rollout.kv_cache_memory_mb / gpu_memory_utilization, or "
                "distributed.cpu_offload_teacher lower it."
            )
        return "\n".join(lines)


def plan_memory(cfg: Config, world_size: int, device_gb: float | None) -> MemoryPlan:
    """The per-rank plan of `cfg` on `world_size` ranks of `device_gb` each (None = unknown)."""
    config, config_source = hf_config(cfg.model)
    shape = model_shape(config, cfg.model.lora)
    dist, train, rollout = cfg.distributed, cfg.train, cfg.rollout
    shard = (dist.shard_size or world_size) if world_size > 1 else 1
    P = shape.parameters
    compute = DTYPE_BYTES[cfg.model.dtype]
    gathered_bytes = DTYPE_BYTES[dist.param_dtype]  # used only when sharded
    rows: list[tuple[str, float, str]] = []

    def add(item: str, nbytes: float, how: str) -> float:
        rows.append((item, nbytes / GB, how))
        return nbytes / GB

    per = f"/ {shard} ranks" if shard > 1 else "(unsharded)"
    lora = cfg.model.lora
    A = shape.lora_parameters
    # A frozen vision tower (model.freeze_vision) of a full-weight student has no gradients or optimizer
    # state, and a copied teacher shares it in one process (sharded, each keeps its own shards of it).
    V = shape.vision_parameters if cfg.model.freeze_vision and not lora else 0
    if lora:  # a frozen base: gradients and AdamW states for the adapter only
        static = add("student weights", (DTYPE_BYTES[lora.base_dtype] * P + 4 * A) / shard,
                     f"frozen {lora.base_dtype} base + float32 adapter ({A / 1e6:.0f}M) {per}")
        static += add("gradients", 4 * A / shard, f"float32, adapter only {per}")
        static += add("optimizer", 8 * A / shard, f"AdamW: 2 float32 states, adapter only {per}")
    else:
        frozen = f", vision tower frozen ({V / 1e6:.0f}M)" if V else ""
        static = add("student weights", 4 * P / shard, f"float32 master {per}")
        static += add("gradients", 4 * (P - V) / shard,
                      f"float32 {per}" + (", reduce-scattered every micro-step" if shard > 1 else "") + frozen)
        static += add("optimizer", 8 * (P - V) / shard, f"AdamW: 2 float32 states {per}{frozen}")
    teacher = teacher_class(cfg.teacher, lora_student=lora is not None)
    own = teacher_shape(cfg) if teacher.LOADS_MODEL else None  # a model teacher of its own
    teacher_bytes = DTYPE_BYTES[cfg.teacher.dtype]
    shared = V if shard == 1 else 0
    memory = TeacherMemory(copy_bytes=4 * (P - shared) / shard, adapter_bytes=4 * A / shard, per=per,
                           offloaded=dist.cpu_offload_teacher and world_size > 1,
                           shared="the frozen vision tower" if shared else "",
                           model_bytes=teacher_bytes * own.parameters / shard if own else 0.0, model_dtype=cfg.teacher.dtype)
    label = f"teacher ({cfg.teacher.mode}{f', {own.parameters / 1e9:.1f}B' if own else ''})"
    teacher_gb = add(label, *teacher.memory_row(memory))
    static += teacher_gb
    static += add("CUDA context, NCCL, slack", CONTEXT_GB * GB, "estimate")
    hints = []
    if own and cfg.teacher.dtype == "float32" and not memory.offloaded:
        hints.append(f"teacher.dtype=bfloat16 (with model.dtype=bfloat16) saves {teacher_gb / 2:.1f} GB")
    if own and shard < world_size:
        hints.append(f"distributed.shard_size={world_size} shards the teacher over all {world_size} ranks")

    gathered = 0.0
    if shard > 1:
        # A frozen copy gathers like the student; a model teacher its own units, in its dtype when bfloat16.
        teacher_gather = DTYPE_BYTES["bfloat16"] if own and cfg.teacher.dtype == "bfloat16" else gathered_bytes
        t_root, t_block = (own.root_parameters, own.largest_block) if own else (
            (shape.root_parameters, shape.largest_block) if teacher.HOLDS_COPY else (0, 0))
        roots = 2 if own or teacher.HOLDS_COPY else 1
        block_bytes = max(shape.largest_block * gathered_bytes, t_block * teacher_gather)
        gathered = add(
            "gathered FSDP units",
            shape.root_parameters * gathered_bytes + t_root * teacher_gather + 2 * block_bytes,
            f"{dist.param_dtype}: {roots} root unit(s) ({shape.root_parameters / 1e9:.2f}B"
            f"{f' + {t_root / 1e9:.2f}B' if own else ''}) + 2 blocks ({block_bytes / gathered_bytes / 1e6:.0f}M each)",
        )

    sequences = cfg.micro_batch_size
    tokens = sequences * train.max_forward_tokens
    checkpointing = dist.activation_checkpointing
    activations = _block_activations(
        tokens, shape.layers, shape.hidden, shape.intermediate, shape.kv_dim, compute, checkpointing
    )
    vision_note = ""
    if shape.vision:
        v = shape.vision
        per_image = (v["image_size"] // v["patch"]) ** 2 if v["image_size"] else cfg.data.max_image_pixels / v["patch"] ** 2
        patches = min(sequences * cfg.data.max_problem_images * per_image, tokens * v["merge"] ** 2)
        activations += _block_activations(
            int(patches), v["layers"], v["hidden"], v["intermediate"], 2 * v["hidden"], compute, checkpointing
        )
        vision_note = f" + vision tower on {int(patches)} patches"
    add(
        "activations (estimate)", activations,
        f"{sequences} sequence(s) x {train.max_forward_tokens} tokens{vision_note}, "
        f"checkpointing {'on' if checkpointing else 'off'}",
    )
    if own:  # no grad: one block's working set at a time, beside the student's kept activations
        activations += add(
            "teacher forward (estimate)",
            _block_activations(tokens, 1, own.hidden, own.intermediate, own.kv_dim, compute, False),
            f"one of its blocks at a time, no grad ({own.layers} layers, hidden {own.hidden})",
        ) * GB
    completion = sequences * min(rollout.max_new_tokens, train.max_forward_tokens)
    logits = completion * shape.vocab * 3 * compute + min(completion, build_loss(cfg.loss).chunk_rows) * shape.vocab * 4 * 6
    add("logits (estimate)", logits, f"{completion} completion positions x {shape.vocab} (both roles, loss chunks in float32)")
    training_extra = gathered + (activations + logits) / GB

    engine_awake, engine_asleep = _engine(cfg, shape, world_size, device_gb, add)
    return MemoryPlan(
        world_size=world_size, shard_size=shard, device_gb=device_gb, config_source=config_source, shape=shape,
        rows=rows, rollout_gb=static + engine_awake, training_gb=static + training_extra + engine_asleep, hints=hints,
    )


def teacher_shape(cfg: Config) -> ModelShape:
    """The shape of a model teacher (`teacher.path`), from its config alone, as the student's."""
    from opsd.modeling import teacher_model_config

    config, _ = hf_config(teacher_model_config(cfg.model, cfg.teacher))
    return model_shape(config)


def _engine(cfg: Config, shape: ModelShape, world_size: int, device_gb: float | None, add) -> tuple[float, float]:
    """(awake, asleep) GB of the rollout engine on this rank."""
    rollout = cfg.rollout
    if rollout.engine == "server":
        add("engine (server)", 0, "a separate process; its GPU is not counted here")
        return 0.0, 0.0
    if rollout.engine == "hf":
        weights = 4 * shape.parameters
        add("engine (hf)", weights, "its own float32 copy of the weights")
        return weights / GB, weights / GB
    if rollout.engine != "vllm":
        add("engine (custom)", 0, "not counted")
        return 0.0, 0.0
    weights = DTYPE_BYTES[cfg.model.dtype] * shape.parameters / rollout.tensor_parallel_size
    if rollout.kv_cache_memory_mb is not None:
        awake = add(
            "engine, awake", weights + rollout.kv_cache_memory_mb * 2**20 + ENGINE_RUNTIME_GB * GB,
            f"{cfg.model.dtype} weights / TP {rollout.tensor_parallel_size} + KV cache {rollout.kv_cache_memory_mb} MiB "
            f"+ ~{ENGINE_RUNTIME_GB:.0f} GB runtime",
        )
    elif device_gb is not None:
        awake = add(
            "engine, awake", rollout.gpu_memory_utilization * device_gb * GB,
            f"gpu_memory_utilization {rollout.gpu_memory_utilization} x {device_gb:.0f} GB "
            f"(weights {weights / GB:.1f} GB + KV cache + runtime)",
        )
    else:
        awake = add("engine, awake", weights, "weights only: the KV cache share needs the device memory")
    asleep = awake
    if rollout.sleep_mode:
        adapters = cfg.model.lora and rollout.lora_sync == "adapter"  # the base is never re-synced: kept on the host
        level = "1 (weights to host memory)" if adapters else "2 (weights released)"
        asleep = add("engine, asleep", ENGINE_ASLEEP_GB * GB, f"sleep level {level} and KV cache released while training")
    return awake, asleep


def detected_device_gb() -> float | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GB
    return None

