"""Load the student's processor and weights from a Hugging Face directory (built locally on request)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from opsd.config import ConfigError, ModelConfig, TeacherConfig
from opsd.prompts import is_multimodal, tokenizer_of
from opsd.vl_processor import load_image_only_processor


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
        }[cfg.build]
        build(path)
    # A hub id is `name` or `org/name`; `artifacts/tiny-vlm` is local when `artifacts/` is.
    looks_local = (path.exists() or cfg.path.startswith((".", "/", "~")) or cfg.path.count("/") > 1
                   or (cfg.path.count("/") == 1 and path.parent.is_dir()))
    if looks_local and not (path / "config.json").exists():
        missing = "config.json missing" if path.is_dir() else "no such directory"
        raise ConfigError(f"model.path: no Hugging Face model directory at {path} ({missing}); set model.path to "
                          "a model directory, or model.build to build one there")
    return cfg.path


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
