"""Load the student's processor and weights from a Hugging Face directory (built locally on request)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from opsd.config import ConfigError, ModelConfig, TeacherConfig
from opsd.prompts import is_multimodal, tokenizer_of
from opsd.vl_processor import load_image_only_processor


class DefaultConfigWarning(logging.Filter):
    """Drops transformers' warning about a config it builds itself: to save, print or compare any
    Idefics3 config it diffs it against a default `Idefics3Config()` (`to_diff_dict`), whose
    pad_token_id 128002 lies outside the default Llama vocabulary of 32000, so every load of an
    Idefics3 model (the tiny VLM, SmolVLM), `--dry-run` included, warned about a config that is not
    the user's. The same warning about a loaded config (another id or vocabulary) still shows."""

    MESSAGE = "Model config: pad_token_id must be `None` or an integer within the vocabulary (between 0 and 31999), got 128002."

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.MESSAGE)


def quiet_default_config_warning() -> None:
    """Install `DefaultConfigWarning` on the transformers logger that emits it (once per process)."""
    logger = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, DefaultConfigWarning) for f in logger.filters):
        logger.addFilter(DefaultConfigWarning())


quiet_default_config_warning()  # at import: the warning comes from transformers' own default instance


def prepare_model_dir(cfg: ModelConfig) -> str:
    """A local model directory (built first when `model.build` asks), or a hub id left to the loaders."""
    path = Path(cfg.path)
    if cfg.build and not (path / "config.json").exists():
        from functools import partial

        from opsd import convert_smollm2, smollm2_vlm, tiny_models

        build = {
            "tiny-vlm": tiny_models.build_tiny_vlm,
            "tiny-vlm-large": partial(tiny_models.build_tiny_vlm, large=True),
            "tiny-text-large": partial(tiny_models.build_tiny_text_model, large=True),
            "tiny-paddleocr-vl": tiny_models.build_tiny_paddleocr_vl,
            "tiny-qwen2.5-vl": tiny_models.build_tiny_qwen25_vl,
            "tiny-qwen3-vl": tiny_models.build_tiny_qwen3_vl,
            "tiny-text": tiny_models.build_tiny_text_model,
            "smollm2": convert_smollm2.convert,
            "smollm2-vlm": smollm2_vlm.build,
            "smollm2-vlm-digits": smollm2_vlm.build_digits,
        }[cfg.build]
        build(path)
    # A hub id is `name` or `org/name`; `artifacts/tiny-vlm` is local when `artifacts/` is.
    looks_local = (path.exists() or cfg.path.startswith((".", "/", "~")) or cfg.path.count("/") > 1
                   or (cfg.path.count("/") == 1 and path.parent.is_dir()))
    if looks_local and not (path / "config.json").exists():
        missing = "config.json missing" if path.is_dir() else "no such directory"
        raise ConfigError(f"model.path: no Hugging Face model directory at {path} ({missing}); set model.path to "
                          "a model directory, or model.build to build one there")
    if path.is_dir():
        check_weight_files(path)
    return cfg.path


def check_weight_files(model_dir: Path) -> None:
    """Every safetensors file of a local model directory is whole: its header parses and its size is
    what the header says. Caught here, a truncated or garbled file is one line naming it, before any
    engine or loader reads it (they fail deep inside, each in its own words)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as err:
            raise ConfigError(f"model.path: {index} is corrupt ({type(err).__name__}: {err})") from None
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise ConfigError(f"model.path: {model_dir / shard} is missing ({index.name} lists it)")
    for file in sorted(model_dir.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            raise ConfigError(f"model.path: {file} is corrupt: {problem}; restore it (or rebuild the directory: "
                              "model.build builds it again when config.json is missing)")


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing (8-byte header length, JSON header, data of the
    size the header's offsets say), or None. The tensors' bytes themselves are not checked."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        length = struct.unpack("<Q", head)[0]
        if length > size - 8:
            return f"its header says {length} bytes of metadata, the file has {size} bytes (truncated or garbled)"
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            return f"its header is not safetensors metadata ({type(err).__name__}; garbled)"
    if 8 + length + end != size:
        return f"{size} bytes, its header says {8 + length + end} ({'truncated' if size < 8 + length + end else 'trailing bytes'})"
    return None


def load_processor(cfg: ModelConfig):
    try:
        processor = AutoProcessor.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    except ImportError as err:
        if "torchvision" not in str(err).lower():
            raise
        # Qwen-VL processors hold a video processor that needs torchvision; images need only PIL.
        processor = load_image_only_processor(cfg.path, trust_remote_code=cfg.trust_remote_code)
    except OSError as err:  # a hub id that is not in the cache and cannot be downloaded, or not a model
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"model.path {cfg.path!r}: not a local model directory, and loading it as a Hugging Face "
                          f"hub model failed: {reason}") from None
    tokenizer = tokenizer_of(processor)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def model_class(multimodal: bool):
    return AutoModelForImageTextToText if multimodal else AutoModelForCausalLM


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def teacher_model_config(model: ModelConfig, teacher: TeacherConfig) -> ModelConfig:
    """The `ModelConfig` a model teacher (`teacher.mode: model`) loads with: its own path and build,
    the student's compute dtype, remote-code and attention settings; nothing of it trains."""
    return ModelConfig(path=teacher.path, build=teacher.build, dtype=model.dtype, trust_remote_code=model.trust_remote_code,
                       attn_implementation=model.attn_implementation)


def _options(cfg: ModelConfig, dtype: str = "float32") -> dict:
    options = {"dtype": DTYPES[dtype], "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        options["attn_implementation"] = cfg.attn_implementation
    return options


def load_model(cfg: ModelConfig, processor, device: torch.device) -> torch.nn.Module:
    """Master weights in float32; bfloat16 runs use autocast on top. The vision tower is frozen when
    `model.freeze_vision` asks."""
    model = model_class(is_multimodal(processor)).from_pretrained(cfg.path, **_options(cfg))
    if cfg.freeze_vision:
        freeze_vision(model)
    return model.to(device)


def load_frozen_model(cfg: ModelConfig, processor, device: torch.device, dtype: str = "float32") -> torch.nn.Module:
    """A model that never trains (a model teacher): its weights in `dtype`, eval mode, no gradients."""
    model = model_class(is_multimodal(processor)).from_pretrained(cfg.path, **_options(cfg, dtype))
    return model.to(device).eval().requires_grad_(False)


def decoder_prefix(model: torch.nn.Module) -> str:
    """The module name of the language model (`model.language_model`, `model.text_model`, ...)."""
    decoder = model.get_decoder()
    return next(name for name, module in model.named_modules() if module is decoder)


def vision_parameter_names(model: torch.nn.Module) -> list[str]:
    """The vision tower's and the connector's parameters: every one outside the language model and
    the LM head (Idefics3's `model.vision_model` and `model.connector`, Qwen-VL's `model.visual` with
    its mergers, PaddleOCR-VL's `model.visual` and `model.projector`); none for a text model."""
    if getattr(model.config, "vision_config", None) is None:
        return []
    decoder = decoder_prefix(model) + "."
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    return [name for name, p in model.named_parameters() if not name.startswith(decoder) and id(p) not in head]


def freeze_vision(model: torch.nn.Module) -> list[str]:
    """`model.freeze_vision`: no gradients for the vision tower and connector; their names."""
    names = vision_parameter_names(model)
    if not names:
        raise ConfigError(f"model.freeze_vision: {type(model).__name__} has no vision tower to freeze")
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    return names


def empty_model(cfg: ModelConfig, processor, dtype: str = "float32") -> torch.nn.Module:
    """The model without its weights: parameters on the meta device, buffers (rotary tables) real.

    Nothing is read from the weight files; under torchrun the ranks shard this and take their
    shards of the weights rank 0 read (`opsd.trainer.fsdp.load_sharded`).
    """
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = model_class(is_multimodal(processor)).from_config(config, **_options(cfg, dtype))
    if (Path(cfg.path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(cfg.path)
    if cfg.freeze_vision:
        freeze_vision(model)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block's activations in the backward (one process or FSDP).

    Non-reentrant checkpointing keeps FSDP's hooks working in the recomputed forward.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
