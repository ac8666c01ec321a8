"""The one mapping from opsd's settings to vLLM's: engine arguments, sampling parameters, environment.

The colocated engine (`vllm.LLM(**engine_args(...))`), the server launcher (`vllm serve` flags from the
same dict, opsd/rollout/serve.py) and the server engine (its `sampling_params` JSON) all use these
functions, so the two engines sample alike.
"""

from __future__ import annotations

import json

import torch

from opsd.rollout.engine import SamplingSettings

# On CPU, vLLM 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
# split across scheduler steps: it rewinds the generator offset, which only CUDA generators have.
# A large per-step token budget keeps a rollout batch's prefills in one step.
CPU_MAX_BATCHED_TOKENS = 65536


def images_per_prompt(cfg) -> int:
    """Most images one engine prompt holds: the problem images, plus the privileged ones when the
    teacher's prompt is evaluated too."""
    teacher_images = cfg.eval.every and cfg.eval.with_teacher_prompt and "images" in cfg.prompts.privileged
    return cfg.data.max_problem_images + (cfg.data.max_reference_rounds if teacher_images else 0)


def engine_args(
    model_path: str, *, dtype: str, max_model_len: int, max_images_per_prompt: int, kv_cache_memory_mb: int | None,
    gpu_memory_utilization: float, enforce_eager: bool, seed: int, sleep_mode: bool, trust_remote_code: bool,
    max_lora_rank: int | None = None,
) -> dict:
    """`vllm.LLM` / `vllm serve` engine arguments (EngineArgs names). `max_lora_rank`: serve LoRA
    adapters up to this rank, one at a time (each weight sync brings a new one and retires the last)."""
    args = {
        "model": str(model_path),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "limit_mm_per_prompt": {"image": max_images_per_prompt},
        "gpu_memory_utilization": gpu_memory_utilization,
        "seed": seed,
    }
    if kv_cache_memory_mb:
        args["kv_cache_memory_bytes"] = kv_cache_memory_mb << 20
    # vLLM 0.32's CPU build crashes in compilation ("aot_compile is not supported"): eager there always.
    if enforce_eager or not torch.cuda.is_available():
        args["enforce_eager"] = True
    if sleep_mode and torch.cuda.is_available():  # vLLM refuses sleep mode on CPU
        args["enable_sleep_mode"] = True
    if trust_remote_code:
        args["trust_remote_code"] = True
    if max_lora_rank:
        from opsd.lora import vllm_max_lora_rank

        args.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(max_lora_rank), max_loras=1, max_cpu_loras=1)
    if not torch.cuda.is_available():
        args["max_num_batched_tokens"] = CPU_MAX_BATCHED_TOKENS
    return args


def engine_options(cfg, model_path) -> dict:
    """The keyword arguments of `engine_args` (and of `VLLMEngine`) that a run config sets."""
    r = cfg.rollout
    return dict(
        model_path=str(model_path), dtype=cfg.model.dtype, max_model_len=cfg.train.max_forward_tokens,
        max_images_per_prompt=images_per_prompt(cfg), kv_cache_memory_mb=r.kv_cache_memory_mb,
        gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager, seed=cfg.train.seed,
        sleep_mode=r.sleep_mode, trust_remote_code=cfg.model.trust_remote_code,
        max_lora_rank=cfg.model.lora.rank if cfg.model.lora and r.lora_sync == "adapter" else None,
    )


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
