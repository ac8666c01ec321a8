"""The rollout engines agree with the trainer's forward (float32) before and after a weight update."""

import pytest
import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.synthetic import generate_samples
from opsd.modeling import load_model, load_processor
from opsd.rollout.weight_sync import push_weights, sync_student
from opsd.prompts import placeholder_token_ids, student_prompt
from opsd.rollout.engine import SamplingSettings
from tests.helpers.logprobs import TOLERANCE, engine_logprobs, trainer_logprobs
from tests.helpers.samples import text_samples


def make_engine(kind, model_dir, processor):
    if kind == "vllm":
        from opsd.rollout.vllm_args import VLLMOptions
        from opsd.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(VLLMOptions(str(model_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
    from opsd.rollout.hf_engine import HFEngine

    return HFEngine(load_model(ModelConfig(path=str(model_dir)), processor, torch.device("cpu")), processor)


@pytest.mark.parametrize("kind", [pytest.param("vllm", marks=pytest.mark.vllm), "hf"])
@pytest.mark.parametrize("model", ["vlm", "paddleocr-vl", "text"])
def test_engine_matches_trainer_before_and_after_update(kind, model, request):
    """Idefics3 (fixed-size images) and PaddleOCR-VL (flat patches of any aspect ratio, 3-D positions):
    the two VLM architectures vLLM serves on CPU, and a text model."""
    model_dir = request.getfixturevalue({"vlm": "tiny_vlm_dir", "paddleocr-vl": "tiny_paddleocr_vl_dir", "text": "tiny_text_dir"}[model])
    processor = load_processor(ModelConfig(path=str(model_dir)))
    trainer = load_model(ModelConfig(path=str(model_dir)), processor, torch.device("cpu"))
    samples = text_samples(3) if model == "text" else generate_samples(3, seed=1)
    prompts = [student_prompt(s, processor, PromptConfig()) for s in samples]
    sampling = SamplingSettings(max_new_tokens=12, n=2, seed=7, banned_token_ids=placeholder_token_ids(processor))
    engine = make_engine(kind, model_dir, processor)
    try:
        first = engine.generate(prompts, sampling)
        assert len(first) == 6 and [c.prompt_index for c in first] == [0, 0, 1, 1, 2, 2]
        assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in first)
        assert not {t for c in first for t in c.token_ids} & set(sampling.banned_token_ids)
        gap = (trainer_logprobs(trainer, processor, prompts, first) - engine_logprobs(first)).abs().max()
        assert gap < TOLERANCE

        # Same seed, same weights: the same completions.
        assert [c.token_ids for c in engine.generate(prompts, sampling)] == [c.token_ids for c in first]

        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = (trainer_logprobs(trainer, processor, prompts, first) - engine_logprobs(first)).abs().max()
        assert stale > 1e-2  # the check below can fail: old weights disagree

        # As a run syncs (PaddleOCR-VL's weights go to vLLM under their on-disk names); small buckets split fused layers.
        stats = sync_student(trainer, engine, bucket_mb=0.05)
        assert stats.buckets > 10 and stats.tensors == len(list(trainer.parameters()))
        second = engine.generate(prompts, sampling)
        gap = (trainer_logprobs(trainer, processor, prompts, second) - engine_logprobs(second)).abs().max()
        assert gap < TOLERANCE
    finally:
        engine.close()


@pytest.mark.vllm
def test_vllm_update_changes_engine_weights(tiny_vlm_dir):
    """Digests of the engine's parameters move with an update (CPU prepacks linear layers, whose
    parameter objects are left empty; norms, embeddings and biases are still visible)."""
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    processor = load_processor(ModelConfig(path=str(tiny_vlm_dir)))
    trainer = load_model(ModelConfig(path=str(tiny_vlm_dir)), processor, torch.device("cpu"))
    engine = VLLMEngine(VLLMOptions(str(tiny_vlm_dir), max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
    try:
        before = engine.weight_checksums()
        push_weights(trainer, engine, bucket_mb=0.05)
        assert engine.weight_checksums() == before  # same weights: nothing moves
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01)
        push_weights(trainer, engine, bucket_mb=0.05)
        after = engine.weight_checksums()
        changed = [k for k in before if before[k] != after[k]]
        assert any("embed_tokens" in k for k in changed) and any("norm" in k for k in changed)
    finally:
        engine.close()


@pytest.mark.vllm
def test_vllm_seeded_sampling_of_a_batch_larger_than_one_prefill_step(tiny_text_dir):
    """vLLM 0.32 on CPU crashes when a seeded request's prefill is split across scheduler steps
    ("CPU Generator does not use offset"); the engine's token budget keeps the prefill in one step."""
    from opsd.prompts import Prompt
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    words = " ".join(["step path maze grid answer think"] * 20)
    prompts = [Prompt(f"<|im_start|>user\n{i} {words}<|im_end|>\n<|im_start|>assistant\n", []) for i in range(40)]
    engine = VLLMEngine(VLLMOptions(str(tiny_text_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
    try:
        assert sum(len(engine.tokenizer(p.text)["input_ids"]) for p in prompts) > 4096  # vLLM's default budget
        completions = engine.generate(prompts, SamplingSettings(max_new_tokens=4, seed=1))
        assert len(completions) == 40 and all(c.token_ids for c in completions)
    finally:
        engine.close()
