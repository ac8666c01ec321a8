"""LoRA training with `peft`: adapters on the student, the adapter-based teachers, what the engine gets.

`add_lora` injects the adapter layers into the Hugging Face model in place (the module stays the
transformers model the trainer scores with; adapted layers become `peft` LoRA layers, their weights
named `<layer>.base_layer.weight`, `<layer>.lora_A.<adapter>.weight`, ...). Only the `default`
adapter trains. With `teacher.mode=ema` a second adapter, `ema`, holds the EMA of the default one and
is switched in for the teacher's forward; `teacher.mode=base` switches the adapters off.

An adapter travels (checkpoints, the engine, export) in the PEFT directory format:
`adapter_config.json` + `adapter_model.safetensors` with keys `base_model.model.<layer>.lora_A.weight`.

`peft` is imported by the functions that need it, so a run without LoRA never loads it (0.6 s of
every process's start: each torchrun rank, each CLI).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors.torch import save_file

from opsd.config import LORA_RANKS_VLLM, ConfigError, LoraConfig
from opsd.modeling import decoder_prefix

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

STUDENT_ADAPTER, EMA_ADAPTER = "default", "ema"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""Keys of a PEFT adapter file are those of a `PeftModel`, i.e. the transformers names under this."""


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name -> `peft` LoRA layer of every adapted module of `model`."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def target_pattern(model: torch.nn.Module, cfg: LoraConfig) -> str:
    """A regex over module names (`peft`'s `target_modules`): the listed layers of the language model
    and, when asked, of the rest (vision tower, connector); never the LM head."""
    decoder = re.escape(decoder_prefix(model))
    alternatives = []
    if cfg.target_modules:
        alternatives.append(rf"{decoder}\.(.*\.)?({'|'.join(cfg.target_modules)})")
    if cfg.vision_target_modules:
        alternatives.append(rf"(?!{decoder}\.)(.*\.)?({'|'.join(cfg.vision_target_modules)})")
    return "^(" + "|".join(alternatives) + ")$"


def add_lora(model: torch.nn.Module, cfg: LoraConfig, *, ema: bool = False) -> torch.nn.Module:
    """Inject a trainable adapter (and, with `ema`, a frozen copy of it named `ema`) into `model`; the
    base weights freeze. Returns the same module."""
    pattern = target_pattern(model, cfg)
    if not any(re.fullmatch(pattern, name) for name, _ in model.named_modules()):
        raise ConfigError(f"model.lora.target_modules: no layer of the model is named {cfg.target_modules} "
                         f"(e.g. {[n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][:3]})")
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=pattern,
        base_model_name_or_path=_base_model_path(model),
    )
    peft_model = get_peft_model(model, peft_config)  # freezes everything but the default adapter
    inner = peft_model.base_model.model
    if cfg.base_dtype != "float32":
        for name, param in inner.named_parameters():
            if ".lora_" not in name:
                param.data = param.data.to(getattr(torch, cfg.base_dtype))
    if ema:
        peft_model.add_adapter(EMA_ADAPTER, peft_config)
        for param in adapter_parameters(inner, EMA_ADAPTER).values():
            param.requires_grad_(False)
        reset_ema_adapter(inner)
    return inner


@torch.no_grad()
def reset_ema_adapter(model: torch.nn.Module) -> None:
    """The EMA adapter starts as a copy of the student's (shard by shard when sharded)."""
    student = adapter_parameters(model)
    for name, param in adapter_parameters(model, EMA_ADAPTER).items():
        param.copy_(student[name])


def _base_model_path(model: torch.nn.Module) -> str | None:
    """Where the base weights come from, as the adapter's config records it (absolute when local, so
    that `opsd.export --merge` finds it from anywhere)."""
    path = getattr(model, "name_or_path", None)
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def adapter_parameters(model: torch.nn.Module, adapter: str = STUDENT_ADAPTER) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters under the names they have in the student (`...lora_A.default.weight`),
    the `default` adapter's names also for the EMA adapter (so the two line up key for key)."""
    marker = f".{adapter}."
    return {
        name.replace(marker, f".{STUDENT_ADAPTER}."): param
        for name, param in model.named_parameters()
        if ".lora_" in name and marker in name
    }


@contextlib.contextmanager
def active_adapter(model: torch.nn.Module, adapter: str | None):
    """Run the model with another adapter (`None`: none, the base weights) inside the block.

    Sets peft's layer flags directly: `set_adapter`/`enable_adapters` would also flip `requires_grad`
    of the student's adapter, which the optimizer and FSDP hold on to.
    """
    layers = list(lora_layers(model).values())
    saved = [(m._active_adapter, m._disable_adapters) for m in layers]
    for m in layers:
        if adapter is None:
            m._disable_adapters = True
        else:
            m._active_adapter = [adapter]
    try:
        yield
    finally:
        for m, (active, disabled) in zip(layers, saved):
            m._active_adapter, m._disable_adapters = active, disabled


# --- the adapter as a set of full tensors -----------------------------------------------------------

def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def adapter_tensors(model: torch.nn.Module, adapter: str = STUDENT_ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter's full tensors under PEFT file keys (sharded ones gathered: every rank calls this)."""
    return {
        PEFT_PREFIX + name.replace(f".{STUDENT_ADAPTER}.", "."): _full(param)
        for name, param in adapter_parameters(model, adapter).items()
    }


def write_adapter_dir(path: Path, tensors: dict[str, torch.Tensor], config: PeftLoraConfig) -> int:
    """A PEFT adapter directory (what `PeftModel.from_pretrained` and vLLM's LoRARequest read); returns
    the bytes of the weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_adapter(model: torch.nn.Module, path: Path, *, adapter: str = STUDENT_ADAPTER, write: bool = True) -> None:
    """Gather `adapter` (collective under FSDP) and, where `write`, save it as a PEFT directory."""
    tensors = adapter_tensors(model, adapter)
    if write:
        write_adapter_dir(path, tensors, model.peft_config[STUDENT_ADAPTER])


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    return next(r for r in LORA_RANKS_VLLM if r >= rank)


# --- merged weights ---------------------------------------------------------------------------------

def merged_tensors(model: torch.nn.Module, adapter: str = STUDENT_ADAPTER,
                   exclude: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of every base weight not named in `exclude`, `W + scale * B @ A`
    for adapted layers: the model as plain transformers would hold it, the adapter merged (gathered
    when sharded)."""
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        if ".lora_" in name or name.replace(".base_layer.", ".") in exclude:
            continue
        tensor = _full(param)
        layer_name, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(layer_name) if leaf else None
        if layer is None:
            yield name, tensor
            continue
        if leaf == "weight" and adapter in layer.lora_A:
            a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)
            delta = layer.scaling[adapter] * (b.float() @ a.float())  # in float32 also for a bfloat16 base
            tensor = (tensor.float() + delta).to(tensor.dtype)
        yield f"{layer_name}.{leaf}", tensor


@dataclass
class AdapterUpdate:
    """One adapter sync: the tensors under PEFT file keys and the adapter's PEFT config."""

    tensors: dict[str, torch.Tensor]
    config: PeftLoraConfig

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def adapter_update(model: torch.nn.Module) -> AdapterUpdate:
    return AdapterUpdate(adapter_tensors(model), model.peft_config[STUDENT_ADAPTER])
