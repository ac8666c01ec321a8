"""Scoring: completion-position logits (as the model's own forward computes them, or the model is
refused by name), and both roles' per-token terms of a micro-batch."""

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opsd.config import JsdLossConfig, TinkerLossConfig
from opsd.loss import generalized_jsd, tinker_loss, token_logprobs
from opsd.loss_kinds import build_loss, weighted_loss
from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from opsd.scoring import (Scoring, UnsupportedModelError, check_scoring_matches_forward, completion_logits,
                          packs_shared_prompts, pad_token_id)
from opsd.sequences import EncodedPrompt, collate
from tests.helpers.examples import text_examples, text_model


@pytest.fixture(scope="module")
def model_and_processor(tiny_text_dir):
    return text_model(tiny_text_dir)


def scoring(cfg, processor, **settings) -> Scoring:
    return Scoring(build_loss(cfg), pad_id=pad_token_id(processor), **settings)


def test_completion_logits_are_the_full_forward_at_the_completion_positions(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [3, 5])
    pad = processor.pad_token_id
    batch = collate([e.student for e in examples], [e.completion_ids for e in examples], pad)
    with torch.no_grad():
        full = model(**batch.inputs).logits
        ours = completion_logits(model, batch)
    assert ours.shape == (8, full.shape[-1])
    torch.testing.assert_close(ours, full.flatten(0, 1)[batch.completion_positions], rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_sharing_a_prompt_forward_gives_the_same_scores_and_gradients(model_and_processor, attention):
    assert_sharing_a_prompt_forward_changes_nothing(*model_and_processor, attention)


def test_an_idefics3_model_shares_the_forward_of_its_text_only_prompts(tiny_vlm_dir):
    """A picture-facts student's prompts hold no image: the Idefics3 model packs them as a text model."""
    model, processor = text_model(tiny_vlm_dir)
    assert packs_shared_prompts(model)
    assert_sharing_a_prompt_forward_changes_nothing(model, processor, "sdpa")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_idefics3_model_shares_the_forward_of_prompts_with_pictures(tiny_vlm_dir, attention):
    """The skill task's prompts: a picture for the student, a second for the teacher; a packed row
    holds each picture once, as its prompt does."""
    model, processor = text_model(tiny_vlm_dir)
    batch = assert_sharing_a_prompt_forward_changes_nothing(model, processor, attention, pictures=True)
    # One row: the two prompts share their beginning up to the first picture, then hold their own
    # two pictures each, in order.
    assert batch.inputs["pixel_values"].shape[:2] == (1, 4)
    examples = text_examples(processor, [3, 5], pictures=True)
    alone = scoring(JsdLossConfig(), processor, packed_row_tokens=1024, share_prefix=False).batch(
        model, [e.teacher for e in examples for _ in range(2)], [e.completion_ids for e in examples for _ in range(2)])
    assert alone.inputs["pixel_values"].shape[:2] == (2, 2)  # without: a row per prompt


def assert_sharing_a_prompt_forward_changes_nothing(model, processor, attention, pictures=False):
    """Returns the packed teacher batch."""
    model.config._attn_implementation = attention
    base = text_examples(processor, [3, 5, 4, 2], pictures=pictures)
    # Two samples of each prompt: the examples share their prompt objects, as build_examples pairs them.
    examples = [dataclasses.replace(base[i], completion_ids=base[j].completion_ids, engine_logprobs=base[j].engine_logprobs)
                for i, j in ((0, 0), (0, 1), (2, 2), (2, 3))]
    cfg = JsdLossConfig(top_k=16, ce_weight=0.5)
    results = []
    try:
        for share in (False, True):
            model.zero_grad()
            score = scoring(cfg, processor, packed_row_tokens=1024 if share else None)
            scored = score.micro_batch(model, model, examples)
            scored.token_losses(score.loss).sum().backward()
            results.append((scored, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    finally:
        model.config._attn_implementation = "sdpa"
        model.zero_grad()
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared.student_logits, plain.student_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.teacher_logits, plain.teacher_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.distill, plain.distill, rtol=0, atol=1e-6)
    for got, want in zip(shared_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)  # sums in another order
    packed = score.batch(model, [e.teacher for e in examples], [e.completion_ids for e in examples])
    assert packed.inputs["attention_mask"].dim() == 4  # packed, not a row per sequence
    assert packed.inputs["input_ids"].shape[0] == 1  # the two prompts' shared beginning once
    return packed


def test_a_micro_batch_scores_both_roles_on_the_same_tokens(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [4, 2, 6])
    cfg = JsdLossConfig(top_k=16)
    with torch.no_grad():
        scored = scoring(cfg, processor).micro_batch(model, model, examples)
        teacher_batch = collate([e.teacher for e in examples], [e.completion_ids for e in examples], processor.pad_token_id)
        teacher_logits = completion_logits(model, teacher_batch)
    assert scored.sampled_ids.tolist() == [t for e in examples for t in e.completion_ids]
    assert scored.engine_logprobs.tolist() == pytest.approx([lp for e in examples for lp in e.engine_logprobs])
    torch.testing.assert_close(scored.teacher_logits, teacher_logits)
    expected = generalized_jsd(scored.student_logits, teacher_logits, beta=0.5, top_k=16, token_clip=cfg.token_clip)
    torch.testing.assert_close(scored.distill, expected)
    torch.testing.assert_close(scored.student_logprobs, token_logprobs(scored.student_logits, scored.sampled_ids))
    assert (scored.distill > 0).all()  # the worked solution changes the teacher's predictions


def test_same_prompt_same_weights_gives_a_zero_distillation_term(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [3, 3])
    for e in examples:
        e.teacher = e.student
    with torch.no_grad():
        scored = scoring(JsdLossConfig(), processor).micro_batch(model, model, examples)
    assert scored.distill.abs().max() < 1e-6


def test_tinker_kind_uses_the_sampler_logprobs(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [3])
    with torch.no_grad():
        scored = scoring(TinkerLossConfig(), processor).micro_batch(model, model, examples)
    expected = tinker_loss(scored.student_logits, scored.teacher_logits, scored.sampled_ids,
                           sampler_logprobs=scored.engine_logprobs)
    torch.testing.assert_close(scored.distill, expected)


def test_the_loss_weighs_its_two_parts():
    loss = build_loss(JsdLossConfig(jsd_weight=0.5, ce_weight=2.0))
    assert weighted_loss(loss, 3.0, 1.0) == 3.5
    distill, ce = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    torch.testing.assert_close(weighted_loss(loss, distill, ce), torch.tensor([1.5, 1.5]))
    assert weighted_loss(build_loss(TinkerLossConfig(tinker_weight=0.5, ce_weight=2.0)), 3.0, 1.0) == 3.5


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


@torch.no_grad()
def recomputed_guardrails(s, t, *, beta, temperature, top_k, token_clip, clip_mode):
    """The guardrail sums as the step computed them before they came from the loss's own pass: the
    student's log-softmax, the teacher's top-k and the per-entry terms all computed again."""
    log_s = torch.log_softmax(s.double(), -1)
    entropy = -(log_s.exp() * log_s).sum().item()
    if not top_k:
        return {"teacher_topk_mass": 1.0, "clip_fraction": 0.0, "student_entropy": entropy / len(s)}
    top_t, idx = t.topk(top_k, -1)
    kept = torch.logsumexp(top_t.double() / temperature, -1) - torch.logsumexp(t.double() / temperature, -1)
    ps = torch.softmax(s.double().gather(-1, idx) / temperature, -1)
    pt = torch.softmax(top_t.double() / temperature, -1)
    m = (1 - beta) * ps + beta * pt
    terms = beta * pt * (pt.log() - m.log()) + (1 - beta) * ps * (ps.log() - m.log())
    if clip_mode == "token":
        terms = terms.sum(-1)
    return {"teacher_topk_mass": kept.exp().mean().item(), "clip_fraction": (terms > token_clip).double().mean().item(),
            "student_entropy": entropy / len(s)}


class FullRowPasses(TorchDispatchMode):
    """Counts the calls of some ops, and of those on full-vocabulary rows (last dimension `vocab`)."""

    OPS = ("topk", "_log_softmax", "logsumexp")

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.calls, self.full_rows = vocab, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.calls[name] += 1
            self.full_rows[name] += args[0].shape[-1] == self.vocab
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cfg", [
    JsdLossConfig(top_k=16, token_clip=0.002),
    JsdLossConfig(top_k=16, token_clip=0.02, clip_mode="token", temperature=2.0, beta=0.3),
    TinkerLossConfig(),
], ids=["jsd-entry-clip", "jsd-token-clip-T2", "tinker"])
def test_the_guardrails_come_from_the_loss_pass_and_equal_a_recomputation(model_and_processor, cfg):
    model, processor = model_and_processor
    examples = text_examples(processor, [4, 2, 6])
    score = scoring(cfg, processor)
    vocab = model.get_output_embeddings().weight.shape[0]
    with FullRowPasses(vocab) as ops:
        scored = score.micro_batch(model, model, examples)
    loss = score.loss
    got = {name: value for name, value in scored.guardrails.metrics().items() if name in loss.guardrail_names}
    settings = dict(beta=0.5, temperature=1.0, top_k=0, token_clip=0.0, clip_mode="entry")
    settings.update({k: getattr(cfg, k) for k in settings if hasattr(cfg, k)})
    expected = recomputed_guardrails(scored.student_logits.detach(), scored.teacher_logits, **settings)
    assert got == pytest.approx({name: expected[name] for name in got}, rel=1e-5, abs=1e-7)
    if "clip_fraction" in got:
        assert 0 < got["clip_fraction"] < 1  # the clip bound somewhere, and not everywhere
    # Each full-vocabulary pass once: the student's log-softmax (its logprobs and entropy); for the
    # JSD the teacher's top-k and its log-normaliser (the top-k mass), for tinker the log-normalisers
    # of both roles at the sampled tokens (the loss itself). Before, the guardrails redid the top-k,
    # the student's log-softmax and the teacher's slices.
    jsd = isinstance(cfg, JsdLossConfig)
    assert ops.full_rows == collections.Counter({"_log_softmax": 1, "topk": 1 if jsd else 0, "logsumexp": 1 if jsd else 2})
