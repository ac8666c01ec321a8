"""Rollout: engines that sample completions, and the weight sync that keeps them on-policy."""

from opsd.rollout.engine import Completion, RolloutEngine, SamplingSettings

__all__ = ["Completion", "RolloutEngine", "SamplingSettings", "make_engine"]


def images_per_prompt(cfg) -> int:
    """Most images one engine prompt holds: the problem images, plus the privileged ones when the
    teacher's prompt is evaluated too."""
    teacher_images = cfg.eval.every and cfg.eval.with_teacher_prompt and "images" in cfg.prompts.privileged
    return cfg.data.max_problem_images + (cfg.data.max_reference_rounds if teacher_images else 0)


def make_engine(cfg, model_path, processor) -> RolloutEngine:
    """The configured engine for `model_path`, holding the same weights as the trainer's student."""
    if cfg.rollout.engine == "server":
        from opsd.rollout.server_engine import ServerEngine

        return ServerEngine.from_config(cfg, processor)
    if cfg.rollout.engine not in ("vllm", "hf"):  # an import path, checked at config load
        from opsd.rollout.custom import build_custom_engine

        return build_custom_engine(cfg, model_path, processor)
    if cfg.rollout.engine == "hf":
        from opsd.modeling import load_model
        from opsd.rollout.hf_engine import HFEngine
        from opsd.trainer.device import resolve_device

        return HFEngine(load_model(cfg.model, processor, resolve_device(cfg.train.device)), processor)
    from opsd.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        str(model_path),
        dtype=cfg.model.dtype,
        max_model_len=cfg.train.max_forward_tokens,
        max_images_per_prompt=images_per_prompt(cfg),
        kv_cache_memory_mb=cfg.rollout.kv_cache_memory_mb,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        enforce_eager=cfg.rollout.enforce_eager,
        seed=cfg.train.seed,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        sleep_mode=cfg.rollout.sleep_mode,
        max_lora_rank=cfg.model.lora.rank if cfg.model.lora and cfg.rollout.lora_sync == "adapter" else None,
    )
