"""The supervised baseline (`loss.kind=sft`): checked at config load; its completions are the
samples' privileged texts; its step has no distillation term."""

import math

import pytest

from opsd.config import ConfigError, ModelConfig, load_config
from opsd.data.sample import Sample


def test_sft_needs_cross_entropy_and_privileged_text():
    with pytest.raises(ConfigError, match=r"loss\.ce_weight: Input should be greater than 0"):
        load_config("configs/learn_facts_smollm2.yaml", ["loss={kind: sft, ce_weight: 0}"])
    with pytest.raises(ConfigError, match="prompts.privileged"):
        load_config("configs/learn_facts_smollm2.yaml", ["loss={kind: sft}", "prompts.privileged=[]"])
    cfg = load_config("configs/learn_facts_smollm2.yaml", ["loss={kind: sft}"])
    assert cfg.loss.kind == "sft" and cfg.loss.ce_weight == 1  # the whole loss, weighted 1 unless set


def test_the_plan_of_sft_names_neither_a_teacher_nor_sampling():
    from opsd.train import describe_plan

    sft = describe_plan(load_config("configs/learn_facts_smollm2.yaml", ["loss={kind: sft}"]))
    assert "  no teacher (loss sft); privileged text" in sft and "teacher fixed" not in sft
    assert "rollout engine vllm: no sampling (loss sft); greedy evaluation only" in sft and "T=1.0" not in sft
    jsd = describe_plan(load_config("configs/learn_facts_smollm2.yaml"))
    assert "  teacher fixed; privileged text" in jsd and "up to 16 new tokens, T=1.0" in jsd


def test_switching_the_kind_alone_names_the_other_kinds_settings():
    """The file's jsd settings do not silently vanish under `loss.kind=sft`: the message says which
    keys belong to jsd and how to replace the section."""
    with pytest.raises(ConfigError) as info:
        load_config("configs/learn_facts_smollm2.yaml", ["loss.kind=sft"])
    message = str(info.value)
    assert "loss.beta: a setting of loss.kind=jsd, not of sft" in message and "loss.top_k:" in message
    assert "'loss={kind: sft}'" in message


def test_reference_completions_are_the_privileged_texts(tiny_text_dir):
    from opsd.modeling import load_processor
    from opsd.pipeline import reference_completions

    tokenizer = load_processor(ModelConfig(path=str(tiny_text_dir)))
    samples = [Sample(id=str(i), question="q", images=[], privileged_images=[], privileged_text=f"fact {i}") for i in range(2)]
    completions = reference_completions(samples, tokenizer, n=2)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    for c in completions:
        assert c.token_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(c.token_ids[:-1]) == samples[c.prompt_index].privileged_text
        assert len(c.logprobs) == len(c.token_ids) and all(math.isnan(lp) for lp in c.logprobs)
