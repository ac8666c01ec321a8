"""Scoring reproduces the logits of the model's own forward, or refuses the model by name."""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from opsd.scoring import UnsupportedModelError, check_scoring_matches_forward, completion_logits
from opsd.sequences import EncodedPrompt, collate

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def tiny(model_class, config_class, **extra):
    torch.manual_seed(0)
    model = model_class(config_class(**TINY, **extra)).eval()
    with torch.no_grad():  # large logits, so that softcapping and scaling matter
        model.get_output_embeddings().weight.mul_(20)
    return model


@pytest.mark.parametrize("model", [
    pytest.param(lambda: tiny(Gemma2ForCausalLM, Gemma2Config, final_logit_softcapping=3.0), id="gemma2-softcap"),
    pytest.param(lambda: tiny(CohereForCausalLM, CohereConfig, logit_scale=0.25), id="cohere-logit-scale"),
])
def test_completion_logits_match_forward(model):
    model = model()
    prompt, completion = EncodedPrompt([3, 5, 7, 11]), [13, 17, 19]
    batch = collate([prompt], [completion], pad_id=0)
    with torch.no_grad():
        full = model(**batch.inputs).logits[0, 3:6]
        got = completion_logits(model, batch)
    raw = model.get_output_embeddings()(model.model(**batch.inputs).last_hidden_state)[0, 3:6]
    assert (raw - full).abs().max() > 1.0  # the post-processing changes the logits here
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    check_scoring_matches_forward(model)


class DoubledLogits(Qwen2ForCausalLM):
    """A model whose forward post-processes logits in a way scoring does not know."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_unknown_logit_postprocessing_is_refused_by_name():
    model = tiny(DoubledLogits, Qwen2Config)
    with pytest.raises(UnsupportedModelError, match="model type 'qwen2' \\(DoubledLogits\\)"):
        check_scoring_matches_forward(model)
    check_scoring_matches_forward(tiny(Qwen2ForCausalLM, Qwen2Config))
