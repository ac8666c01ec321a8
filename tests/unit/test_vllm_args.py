"""The one mapping from opsd's settings to vLLM's engine arguments."""

import pytest
import torch

from opsd.config import load_config
from opsd.rollout.vllm_args import CPU_BLOCK_SIZE, CPU_MAX_BATCHED_TOKENS, VLLMOptions, engine_args

COMMON = dict(dtype="float32", max_model_len=512, max_images_per_prompt=2, kv_cache_memory_mb=64,
              gpu_memory_utilization=0.3, seed=3, sleep_mode=True, trust_remote_code=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_cpu_engines_run_eager_bounded_and_without_sleep_mode_whatever_the_config_says():
    args = engine_args(VLLMOptions("m", enforce_eager=False, **COMMON))
    assert args["enforce_eager"] is True  # vLLM's CPU build fails to compile
    assert "enable_sleep_mode" not in args  # refused on CPU
    assert args["max_num_batched_tokens"] == CPU_MAX_BATCHED_TOKENS
    assert args["block_size"] == CPU_BLOCK_SIZE  # a prompt's samples share its full blocks
    assert args["kv_cache_memory_bytes"] == 64 << 20
    assert args["limit_mm_per_prompt"] == {"image": 2} and args["seed"] == 3


def test_options_come_from_the_run_config_whole():
    cfg = load_config("configs/text_opsd_smollm2_lora.yaml", ["rollout.kv_cache_memory_mb=32", "train.seed=7"])
    options = VLLMOptions.from_config(cfg, "model-dir")
    assert options.model_path == "model-dir" and options.max_model_len == cfg.train.max_forward_tokens
    assert options.kv_cache_memory_mb == 32 and options.seed == 7 and options.dtype == cfg.model.dtype
    assert options.max_lora_rank == cfg.model.lora.rank  # adapter sync: the engine serves adapters
    merged = VLLMOptions.from_config(load_config("configs/text_opsd_smollm2_lora.yaml", ["rollout.lora_sync=merged"]), "m")
    assert merged.max_lora_rank is None
    assert engine_args(options)["kv_cache_memory_bytes"] == 32 << 20
