"""The one mapping from opsd's settings to vLLM's: engine arguments, sampling parameters, environment.

The colocated engine (`vllm.LLM(**engine_args(...))`), the server launcher (`vllm serve` flags from the
same dict, opsd/rollout/serve.py) and the server engine (its `sampling_params` JSON) all use these
functions, so the two engines sample alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from opsd.config import ModelConfig, RolloutConfig
from opsd.rollout.engine import SamplingSettings

# On CPU, vLLM 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
# split across scheduler steps: it rewinds the generator offset, which only CUDA generators have.
# A large per-step token budget keeps a rollout batch's prefills in one step.
CPU_MAX_BATCHED_TOKENS = 65536
# vLLM's CPU default is 128-token KV blocks, and its CPU attention takes multiples of 32. A prompt's
# samples share its prefill only in full blocks: with 32 the samples of a prompt of 32 to 127
# tokens share their first blocks instead of computing them each (rollout 0.85x in one pair of
# 4-step runs on the skill task's 42-token prompts, the same completions; docs/rollout.md).
CPU_BLOCK_SIZE = 32


def images_per_prompt(cfg) -> int:
    """Most images one engine prompt holds: the problem images, plus the privileged ones when the
    teacher's prompt is evaluated too."""
    teacher_images = cfg.eval.every and cfg.eval.with_teacher_prompt and "images" in cfg.prompts.privileged
    return cfg.data.max_problem_images + (cfg.data.max_reference_rounds if teacher_images else 0)


@dataclass(frozen=True)
class VLLMOptions:
    """Everything opsd sets on a vLLM engine, in one place: `VLLMEngine(options)` and the server
    launcher (`engine_args(options)`) take it whole. Defaults are the config's (opsd/config.py)."""

    model_path: str
    dtype: str = ModelConfig.dtype
    """Weights and compute dtype (`model.dtype`)."""
    max_model_len: int = 4096
    """Longest prompt + completion (`train.max_forward_tokens`)."""
    max_images_per_prompt: int = 8
    kv_cache_memory_mb: int | None = RolloutConfig.kv_cache_memory_mb
    gpu_memory_utilization: float = RolloutConfig.gpu_memory_utilization
    enforce_eager: bool = RolloutConfig.enforce_eager
    seed: int = 0
    tensor_parallel_size: int = 1
    sleep_mode: bool = RolloutConfig.sleep_mode
    trust_remote_code: bool = False
    max_lora_rank: int | None = None
    """Serve LoRA adapters up to this rank, one at a time (each weight sync brings a new one and
    retires the last); None: no LoRA."""
    max_logprobs: int | None = None
    """Most logprobs (or prompt logprobs) a request may ask per position; None: vLLM's default (20).
    bench/step_profile.py raises it to score a teacher's top-k in the engine."""
    frozen_vision: bool = False
    """`model.freeze_vision`: weight updates after the first leave the vision tower as it was, so the
    engine keeps its image encodings (opsd's own, no vLLM argument)."""

    @classmethod
    def from_config(cls, cfg, model_path) -> "VLLMOptions":
        """The options a run config sets, for the student's directory `model_path`."""
        r = cfg.rollout
        return cls(
            model_path=str(model_path), dtype=cfg.model.dtype, max_model_len=cfg.train.max_forward_tokens,
            max_images_per_prompt=images_per_prompt(cfg), kv_cache_memory_mb=r.kv_cache_memory_mb,
            gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager, seed=cfg.train.seed,
            tensor_parallel_size=r.tensor_parallel_size, sleep_mode=r.sleep_mode,
            trust_remote_code=cfg.model.trust_remote_code,
            max_lora_rank=cfg.model.lora.rank if cfg.model.lora and r.lora_sync == "adapter" else None,
            frozen_vision=cfg.model.freeze_vision,
        )


def engine_args(options: VLLMOptions) -> dict:
    """`vllm.LLM` / `vllm serve` engine arguments (EngineArgs names) of `options`; the tensor-parallel
    launch of colocated engines is opsd/rollout/colocate.py's."""
    args = {
        "model": str(options.model_path),
        "dtype": options.dtype,
        "max_model_len": options.max_model_len,
        "limit_mm_per_prompt": {"image": options.max_images_per_prompt},
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "seed": options.seed,
    }
    if options.kv_cache_memory_mb:
        args["kv_cache_memory_bytes"] = options.kv_cache_memory_mb << 20
    # vLLM 0.32's CPU build crashes in compilation ("aot_compile is not supported"): eager there always.
    if options.enforce_eager or not torch.cuda.is_available():
        args["enforce_eager"] = True
    if options.sleep_mode and torch.cuda.is_available():  # vLLM refuses sleep mode on CPU
        args["enable_sleep_mode"] = True
    if options.trust_remote_code:
        args["trust_remote_code"] = True
    if options.max_lora_rank:
        from opsd.lora import vllm_max_lora_rank

        args.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(options.max_lora_rank), max_loras=1, max_cpu_loras=1)
    if options.max_logprobs:
        args["max_logprobs"] = options.max_logprobs
    if not torch.cuda.is_available():
        args["max_num_batched_tokens"] = CPU_MAX_BATCHED_TOKENS
        args["block_size"] = CPU_BLOCK_SIZE
    return args


def cli_flags(args: dict) -> list[str]:
    """`engine_args` as `vllm serve` flags: `--max-model-len 1024`, `--enforce-eager`, JSON for dicts."""
    flags = []
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def sampling_params(sampling: SamplingSettings, prompt_index: int) -> dict:
    """`vllm.SamplingParams` arguments for prompt `prompt_index` of a call (seed `sampling.seed + i`)."""
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,  # the sampled token's own logprob, from the unprocessed distribution
        "seed": sampling.seed + prompt_index if sampling.temperature > 0 else None,  # temperature 0 is greedy
        "logit_bias": {t: -100.0 for t in sampling.banned_token_ids} or None,
    }


def cpu_environment() -> dict[str, str]:
    """Environment defaults of a vLLM process on a machine without CUDA; empty with CUDA."""
    if torch.cuda.is_available():
        return {}
    # The first logprobs request would otherwise trigger a 10-18 s inductor compile.
    return {"TORCHDYNAMO_DISABLE": "1"}
