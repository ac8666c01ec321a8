"""The logprobs an engine reported for its completions, and the trainer's own for the same tokens."""

import torch

from opsd.loss import token_logprobs
from opsd.scoring import completion_logits, pad_token_id
from opsd.sequences import collate, encode_prompt

TOLERANCE = 1e-4


def trainer_logprobs(model, processor, prompts, completions):
    encoded = [encode_prompt(processor, prompts[c.prompt_index]) for c in completions]
    batch = collate(encoded, [c.token_ids for c in completions], pad_token_id(processor))
    with torch.no_grad():
        return token_logprobs(completion_logits(model, batch), batch.completion_ids)


def engine_logprobs(completions):
    return torch.tensor([lp for c in completions for lp in c.logprobs])


def sample_grid_eval_prompts(model_dir, processor, grid_data_dir):
    """A fresh vLLM engine on `model_dir` samples 2 completions for 3 eval prompts of the grid-path
    set; returns (prompts, completions)."""
    from opsd.config import PromptConfig
    from opsd.data.synthetic import load_samples
    from opsd.prompts import placeholder_token_ids, student_prompt
    from opsd.rollout.engine import SamplingSettings
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    prompts = [student_prompt(s, processor, PromptConfig()) for s in load_samples(grid_data_dir / "eval.parquet")[:3]]
    sampling = SamplingSettings(max_new_tokens=12, n=2, seed=5, banned_token_ids=placeholder_token_ids(processor))
    engine = VLLMEngine(VLLMOptions(str(model_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
    try:
        return prompts, engine.generate(prompts, sampling)
    finally:
        engine.close()
