"""The supervised baseline (`loss.kind=sft`): checked at config load; its completions are the
samples' privileged texts; its step has no distillation term."""

import math

import pytest

from opsd.config import ConfigError, ModelConfig, load_config
from opsd.data.sample import Sample


def test_sft_needs_cross_entropy_and_privileged_text():
    with pytest.raises(ConfigError, match="ce_weight"):
        load_config("configs/learn_facts_smollm2.yaml", ["loss.kind=sft"])
    with pytest.raises(ConfigError, match="prompts.privileged"):
        load_config("configs/learn_facts_smollm2.yaml", ["loss.kind=sft", "loss.ce_weight=1", "prompts.privileged=[]"])
    assert load_config("configs/learn_facts_smollm2.yaml", ["loss.kind=sft", "loss.ce_weight=1"]).loss.kind == "sft"


def test_reference_completions_are_the_privileged_texts(tiny_text_dir):
    from opsd.modeling import load_processor
    from opsd.train import reference_completions

    tokenizer = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id=str(i), question="q", images=[], privileged_images=[], privileged_text=f"fact {i}") for i in range(2)]
    completions = reference_completions(samples, tokenizer, n=2)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    for c in completions:
        assert c.token_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(c.token_ids[:-1]) == samples[c.prompt_index].privileged_text
        assert len(c.logprobs) == len(c.token_ids) and all(math.isnan(lp) for lp in c.logprobs)
