"""vLLM loads the tiny local models and agrees with transformers on tokens, images and logprobs."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from tests.helpers.tiny_inputs import images, vlm_messages


def _hf_logprobs(model, enc, completion):
    """Log-probs the HF model gives each completion token after the prompt."""
    ids = torch.cat([enc["input_ids"], torch.tensor([completion])], dim=1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, -len(completion) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.vllm
def test_vllm_generates_and_matches_transformers(tiny_vlm_dir, tiny_text_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))  # its ZMQ socket files
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    engine_args = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0)

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    hf_vlm = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32)
    llm = LLM(model=str(tiny_vlm_dir), **engine_args)
    prompts = [
        (processor.apply_chat_template(vlm_messages(n), add_generation_prompt=True, tokenize=False), images(n))
        for n in (1, 2)
    ]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in prompts], params)
    for (text, ims), out in zip(prompts, outs):
        enc = processor(text=text, images=ims, return_tensors="pt")
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        completion = list(out.outputs[0].token_ids)
        assert len(completion) == 8
        vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, completion)])
        torch.testing.assert_close(vllm_lp, _hf_logprobs(hf_vlm, enc, completion), atol=1e-4, rtol=0)
    del llm

    tok = AutoTokenizer.from_pretrained(tiny_text_dir)
    hf_text = AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)
    llm = LLM(model=str(tiny_text_dir), **engine_args)
    text = tok.apply_chat_template([{"role": "user", "content": "Which direction?"}], add_generation_prompt=True, tokenize=False)
    out = llm.generate([text], params)[0]
    enc = tok(text, return_tensors="pt")
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    completion = list(out.outputs[0].token_ids)
    vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, completion)])
    torch.testing.assert_close(vllm_lp, _hf_logprobs(hf_text, enc, completion), atol=1e-4, rtol=0)
