"""Scoring: completion-position logits, and both roles' per-token terms of a micro-batch."""

import pytest
import torch

from opsd.config import LossConfig
from opsd.loss import generalized_jsd, tinker_loss, token_logprobs
from opsd.scoring import completion_logits, score_micro_batch, weighted_loss
from opsd.sequences import collate
from tests.helpers.examples import text_examples, text_model


@pytest.fixture(scope="module")
def model_and_processor(tiny_text_dir):
    return text_model(tiny_text_dir)


def test_completion_logits_are_the_full_forward_at_the_completion_positions(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [3, 5])
    pad = processor.pad_token_id
    batch = collate([e.student for e in examples], [e.completion_ids for e in examples], pad)
    with torch.no_grad():
        full = model(**batch.inputs).logits
        ours = completion_logits(model, batch)
    assert ours.shape == (8, full.shape[-1])
    torch.testing.assert_close(ours, full[batch.predicts_completion], rtol=0, atol=1e-5)


def test_a_micro_batch_scores_both_roles_on_the_same_tokens(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [4, 2, 6])
    cfg = LossConfig(top_k=16)
    with torch.no_grad():
        scored = score_micro_batch(model, model, examples, loss_cfg=cfg, dtype="float32", pad_id=processor.pad_token_id)
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
        scored = score_micro_batch(model, model, examples, loss_cfg=LossConfig(), dtype="float32", pad_id=processor.pad_token_id)
    assert scored.distill.abs().max() < 1e-6


def test_tinker_kind_uses_the_sampler_logprobs(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [3])
    cfg = LossConfig(kind="tinker")
    with torch.no_grad():
        scored = score_micro_batch(model, model, examples, loss_cfg=cfg, dtype="float32", pad_id=processor.pad_token_id)
    expected = tinker_loss(scored.student_logits, scored.teacher_logits, scored.sampled_ids,
                           sampler_logprobs=scored.engine_logprobs)
    torch.testing.assert_close(scored.distill, expected)


def test_the_loss_weighs_its_two_parts():
    cfg = LossConfig(jsd_weight=0.5, ce_weight=2.0)
    assert weighted_loss(3.0, 1.0, cfg) == 3.5
    distill, ce = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    torch.testing.assert_close(weighted_loss(distill, ce, cfg), torch.tensor([1.5, 1.5]))
