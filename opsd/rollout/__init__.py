"""Rollout: engines that sample completions, and the weight sync that keeps them on-policy."""

from opsd.config import BUILTIN_ENGINES
from opsd.rollout.engine import (
    Completion, EngineCapabilities, EngineLost, RolloutEngine, SamplingSettings, WeightReceiver, sampling_settings,
)

__all__ = [
    "Completion", "EngineCapabilities", "EngineLost", "RolloutEngine", "SamplingSettings", "WeightReceiver", "builtin_engine",
    "make_engine", "sampling_settings",
]


def make_engine(cfg, model_path, processor) -> RolloutEngine:
    """The configured engine (`rollout.engine`) for `model_path`, holding the same weights as the
    trainer's student: a built-in one, or the class an import path names (opsd/rollout/custom.py)."""
    if cfg.rollout.engine not in BUILTIN_ENGINES:  # an import path, checked at config load
        from opsd.rollout.custom import build_custom_engine

        return build_custom_engine(cfg, model_path, processor)
    return builtin_engine(cfg, model_path, processor, cfg.rollout.engine)


def builtin_engine(cfg, model_path, processor, name: str = "vllm") -> RolloutEngine:
    """The built-in engine `name` (`vllm`, `hf` or `server`) built from the run config as opsd builds
    it, whatever `rollout.engine` says: a custom engine wrapping a built-in one calls this in its
    constructor with the arguments it was given, and declares `capabilities = inner.capabilities`."""
    if name == "server":
        from opsd.rollout.server_engine import ServerEngine

        return ServerEngine.from_config(cfg, processor)
    if name == "hf":
        from opsd.device import resolve_device
        from opsd.modeling import load_model
        from opsd.rollout.hf_engine import HFEngine

        return HFEngine(load_model(cfg.model, processor, resolve_device(cfg.train.device)), processor)
    if name != "vllm":
        raise ValueError(f"builtin_engine: {name!r} is not one of {', '.join(BUILTIN_ENGINES)}")
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(VLLMOptions.from_config(cfg, model_path))
