"""GRPO (`loss.kind: grpo`) and the reward term of the distillation kinds: the policy gradient against
a float64 reference, clipping, zero gradient for a group without signal, and weight 0 leaving `jsd`
and `tinker` bit for bit as they were."""

import copy
import dataclasses

import pytest
import torch

from opsd.config import GrpoLossConfig, JsdLossConfig, TinkerLossConfig
from opsd.loss import grpo_loss
from opsd.loss_kinds import build_loss
from opsd.scoring import Scoring
from opsd.trainer.step import TrainStep
from tests.helpers.examples import text_examples, text_model


def reference_grpo(logits, ids, advantages, old, clip_eps, ref_logits=None, kl_weight=0.0):
    """The formula of docs/training.md (Losses), written out in float64."""
    lp = torch.log_softmax(logits.double(), dim=-1).gather(-1, ids[:, None])[:, 0]
    ratio = torch.exp(lp - old.double())
    a = advantages.double()
    loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    if ref_logits is not None:
        d = torch.log_softmax(ref_logits.double(), dim=-1).gather(-1, ids[:, None])[:, 0] - lp
        loss = loss + kl_weight * (torch.exp(d) - d - 1)
    return loss


def inputs(n=12, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 2
    ids = torch.randint(0, v, (n,), generator=g)
    advantages = torch.randn(n, generator=g)
    return logits, ids, advantages


def grads(fn, logits):
    x = logits.clone().requires_grad_(True)
    out = fn(x)
    out.sum().backward()
    return out.detach(), x.grad


def test_in_sync_the_ratio_is_1_and_the_gradient_is_minus_a_grad_logp():
    logits, ids, advantages = inputs()
    old = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]  # the sampler holds these weights
    got, got_grad = grads(lambda x: grpo_loss(x, ids, advantages, old, clip_eps=0.2), logits)
    want, want_grad = grads(lambda x: reference_grpo(x, ids, advantages, old, 0.2), logits.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-6)
    _, pg_grad = grads(lambda x: -(advantages.double() * torch.log_softmax(x, -1).gather(-1, ids[:, None])[:, 0]), logits.double())
    torch.testing.assert_close(got_grad.double(), pg_grad, rtol=1e-5, atol=1e-6)  # ratio 1: plain policy gradient


@pytest.mark.parametrize("clip_eps", [0.1, 0.2, 0.5])
def test_the_clip_cuts_the_gradient_where_the_sampler_differs(clip_eps):
    logits, ids, advantages = inputs(n=64, seed=1)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    old = lp + torch.linspace(-1.0, 1.0, 64)  # ratios from e^-1 to e^1: many outside the clip
    got, got_grad = grads(lambda x: grpo_loss(x, ids, advantages, old, clip_eps=clip_eps), logits)
    want, want_grad = grads(lambda x: reference_grpo(x, ids, advantages, old, clip_eps), logits.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-6)
    ratio = torch.exp(lp - old)
    clipped = ((ratio > 1 + clip_eps) & (advantages > 0)) | ((ratio < 1 - clip_eps) & (advantages < 0))
    assert clipped.any() and (~clipped).any()
    assert torch.equal(got_grad[clipped], torch.zeros_like(got_grad[clipped]))  # clipped tokens: no gradient
    assert (got_grad[~clipped].abs().sum(-1) > 0).all()


def test_the_kl_to_the_initial_weights_against_the_reference():
    logits, ids, advantages = inputs(seed=2)
    ref = logits + 0.3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    old = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    got, got_grad = grads(lambda x: grpo_loss(x, ids, advantages, old, reference_logits=ref, kl_weight=0.1), logits)
    want, want_grad = grads(lambda x: reference_grpo(x, ids, advantages, old, 0.2, ref, 0.1), logits.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_a_group_whose_rewards_are_all_equal_has_exactly_zero_gradient():
    logits, ids, _ = inputs()
    old = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0] - 0.7
    _, grad = grads(lambda x: grpo_loss(x, ids, torch.zeros(len(ids)), old), logits)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.fixture(scope="module")
def model_and_processor(tiny_text_dir):
    return text_model(tiny_text_dir)


def with_advantages(examples, advantages):
    return [dataclasses.replace(e, advantage=a) for e, a in zip(examples, advantages)]


def step_grads(model, processor, examples, loss_cfg, micro_batch_size=2):
    student = copy.deepcopy(model)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    scoring = Scoring(build_loss(loss_cfg), pad_id=processor.pad_token_id, micro_batch_size=micro_batch_size)
    step = TrainStep(student, student, optimizer, scoring, max_grad_norm=0.0)
    captured = {}
    original = optimizer.step

    def capture(*args, **kwargs):
        captured.update({n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
        return original(*args, **kwargs)

    optimizer.step = capture
    metrics = step(examples)
    return captured, metrics


@pytest.mark.parametrize("loss_cfg", [JsdLossConfig(top_k=16, ce_weight=0.3), TinkerLossConfig()], ids=["jsd", "tinker"])
def test_reward_weight_0_leaves_the_distillation_kinds_bit_for_bit(model_and_processor, loss_cfg):
    model, processor = model_and_processor
    examples = text_examples(processor, [3, 5, 2, 4], seed=1)
    before, before_metrics = step_grads(model, processor, examples, loss_cfg)
    rewarded = with_advantages(examples, [1.0, -1.0, 0.5, -0.5])
    after, after_metrics = step_grads(model, processor, rewarded, dataclasses.replace(loss_cfg, reward_weight=0.0))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert {k: v for k, v in before_metrics.items()} == after_metrics and "grpo_loss" not in after_metrics
    mixed, mixed_metrics = step_grads(model, processor, rewarded, dataclasses.replace(loss_cfg, reward_weight=0.5))
    assert any(not torch.equal(before[name], mixed[name]) for name in before)
    assert mixed_metrics["loss"] == pytest.approx(before_metrics["loss"] + 0.5 * mixed_metrics["grpo_loss"], rel=1e-5)


def test_grpo_step_is_the_reference_and_ignores_the_micro_batches(model_and_processor):
    """Token-level normalisation over the step: the update is the same whatever the micro-batch size;
    all-zero advantages (every group flat) give exactly zero gradient."""
    model, processor = model_and_processor
    examples = with_advantages(text_examples(processor, [3, 6, 2, 4], seed=2), [0.8, -0.8, 1.2, -1.2])
    whole, whole_metrics = step_grads(model, processor, examples, GrpoLossConfig(), micro_batch_size=4)
    split, _ = step_grads(model, processor, examples, GrpoLossConfig(), micro_batch_size=1)
    for name in whole:
        torch.testing.assert_close(whole[name], split[name], rtol=1e-5, atol=1e-7, msg=name)
    assert "grpo_loss" in whole_metrics and "jsd" not in whole_metrics
    flat, _ = step_grads(model, processor, with_advantages(examples, [0.0] * 4), GrpoLossConfig())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in flat.values())
