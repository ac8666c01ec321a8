"""Weight sync into vLLM for a model with tied input/output embeddings (SmolLM2 is one)."""

import pytest
import torch


@pytest.mark.vllm
def test_tied_lm_head_follows_an_embedding_update(tied_text_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.prompts import Prompt
    from opsd.rollout.engine import SamplingSettings
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import push_weights

    tokenizer = AutoTokenizer.from_pretrained(tied_text_dir)
    model = AutoModelForCausalLM.from_pretrained(tied_text_dir, dtype=torch.float32)
    assert [n for n, _ in model.named_parameters() if "embed" in n or "lm_head" in n] == ["model.embed_tokens.weight"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = VLLMEngine(VLLMOptions(str(tied_text_dir), max_model_len=256, kv_cache_memory_mb=32, enforce_eager=True))
    try:
        def mismatch():
            c = engine.generate([Prompt(text=text, images=[])], SamplingSettings(max_new_tokens=8, seed=0))[0]
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + c.token_ids])).logits[0, len(prompt_ids) - 1 : -1]
            ours = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            return (ours - torch.tensor(c.logprobs)).abs().max().item()

        assert mismatch() < 1e-3
        with torch.no_grad():  # a large update of the shared matrix: a stale LM head shows at once
            model.model.embed_tokens.weight.add_(0.05 * torch.randn_like(model.model.embed_tokens.weight))
        push_weights(model, engine)
        assert mismatch() < 1e-3
    finally:
        engine.close()
