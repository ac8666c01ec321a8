"""Rollout: engines that sample completions, and the weight sync that keeps them on-policy."""

from opsd.rollout.engine import Completion, RolloutEngine, SamplingSettings, sampling_settings

__all__ = ["Completion", "RolloutEngine", "SamplingSettings", "make_engine", "sampling_settings"]


def make_engine(cfg, model_path, processor) -> RolloutEngine:
    """The configured engine for `model_path`, holding the same weights as the trainer's student."""
    if cfg.rollout.engine == "server":
        from opsd.rollout.server_engine import ServerEngine

        return ServerEngine.from_config(cfg, processor)
    if cfg.rollout.engine not in ("vllm", "hf"):  # an import path, checked at config load
        from opsd.rollout.custom import build_custom_engine

        return build_custom_engine(cfg, model_path, processor)
    if cfg.rollout.engine == "hf":
        from opsd.device import resolve_device
        from opsd.modeling import load_model
        from opsd.rollout.hf_engine import HFEngine

        return HFEngine(load_model(cfg.model, processor, resolve_device(cfg.train.device)), processor)
    from opsd.rollout.vllm_args import engine_options
    from opsd.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(**engine_options(cfg, model_path), tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                      frozen_vision=cfg.model.freeze_vision)
