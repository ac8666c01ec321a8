"""The optimizer step: global token normalisation, so the update does not depend on the micro-batch size."""

import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opsd.config import JsdLossConfig, TinkerLossConfig
from opsd.loss_kinds import build_loss
from opsd.scoring import Scoring
from opsd.trainer.step import TrainStep, micro_batches
from opsd.trainer.distributed import Ranks
from tests.helpers.examples import text_examples, text_model


@pytest.fixture(scope="module")
def model_and_processor(tiny_text_dir):
    return text_model(tiny_text_dir)


def one_step(model, processor, examples, micro_batch_size, loss_cfg):
    student = copy.deepcopy(model)
    optimizer = torch.optim.SGD(student.parameters(), lr=1.0)  # the update is the gradient itself
    scoring = Scoring(build_loss(loss_cfg), pad_id=processor.pad_token_id, micro_batch_size=micro_batch_size)
    metrics = TrainStep(student, student, optimizer, scoring, max_grad_norm=0.0)(examples)
    return student, metrics


@pytest.mark.parametrize("loss_cfg", [JsdLossConfig(top_k=16, ce_weight=0.3), TinkerLossConfig()], ids=["jsd+ce", "tinker"])
def test_micro_batch_size_leaves_the_update_unchanged(model_and_processor, loss_cfg):
    model, processor = model_and_processor
    examples = text_examples(processor, [2, 7, 3, 5, 1], seed=3)  # uneven lengths: per-batch means would differ
    whole, whole_metrics = one_step(model, processor, examples, 5, loss_cfg)
    for size in (1, 2, 3):
        split, metrics = one_step(model, processor, examples, size, loss_cfg)
        for (name, a), b in zip(whole.named_parameters(), split.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        loss = build_loss(loss_cfg)
        for key in ("loss", loss.metric, "ce", "grad_norm", "completion_tokens", "logprob_mismatch_mean", *loss.guardrail_names):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-7), key
    moved = max((a - b).abs().max().item() for a, b in zip(whole.parameters(), model.parameters()))
    assert moved > 1e-4  # the step did change the weights


def test_metrics_are_token_means_over_the_step(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [4, 2])
    cfg = JsdLossConfig(top_k=16, jsd_weight=1.0, ce_weight=0.5)
    _, metrics = one_step(model, processor, examples, 1, cfg)
    assert metrics["completion_tokens"] == 6 and metrics["completion_len"] == 3
    assert metrics["loss"] == pytest.approx(metrics["jsd"] + 0.5 * metrics["ce"])


def test_a_rank_with_fewer_micro_batches_needs_a_padding_example():
    with pytest.raises(ValueError, match="no padding example"):
        _fewer([], None)


def _fewer(examples, padding):
    """`micro_batches` as a rank that has fewer than the busiest one (2) sees it."""

    class Busier(Ranks):
        def max(self, values):
            return [2]

    return micro_batches(examples, 2, Busier(), padding)


def test_padding_fills_up_to_the_busiest_rank():
    from opsd.sequences import EncodedPrompt, padding_example

    pad = padding_example(EncodedPrompt([1]), EncodedPrompt([1]), 0)
    assert _fewer([], pad) == [[pad], [pad]]


class HostSyncs(TorchDispatchMode):
    """Counts the values opsd's code takes from tensors to the host one by one (`.item()`,
    `float(t)`, `bool(t)`: each a device sync on a GPU); not the model's own (transformers' attention
    mask checks, which a bare forward pays too)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.count += not any("/transformers/" in frame.filename for frame in traceback.extract_stack())
        return func(*args, **(kwargs or {}))


def test_host_syncs_do_not_grow_with_the_micro_batches(model_and_processor):
    model, processor = model_and_processor
    examples = text_examples(processor, [2, 7, 3, 5, 1], seed=3)
    cfg = JsdLossConfig(top_k=16, token_clip=0.01, ce_weight=0.3)  # every guardrail and the CE
    syncs = {}
    for size in (5, 1):  # one micro-batch, then five
        with HostSyncs() as counter:
            one_step(model, processor, examples, size, cfg)
        syncs[size] = counter.count
    assert syncs[1] == syncs[5], syncs  # the step's sums leave the device once, at its end


def test_a_step_with_a_non_finite_gradient_is_not_applied(model_and_processor):
    """A NaN gradient (here from a hook on one weight) leaves every weight and the optimizer's
    moments as they were, and the metrics say so."""
    model, processor = model_and_processor
    student = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    scoring = Scoring(build_loss(JsdLossConfig(top_k=16)), pad_id=processor.pad_token_id, micro_batch_size=2)
    step = TrainStep(student, student, optimizer, scoring, max_grad_norm=1.0)
    examples = text_examples(processor, [3, 4])
    step(examples)  # one good step: the moments hold state
    before = {k: v.clone() for k, v in student.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    hook = next(student.parameters()).register_hook(lambda grad: grad * float("nan"))
    metrics = step(examples)
    hook.remove()
    assert metrics["nonfinite_step"] == 1 and metrics["grad_norm"] != metrics["grad_norm"]  # NaN
    for key, value in student.state_dict().items():
        assert torch.equal(value, before[key]), key
    for param, state in optimizer.state.items():
        assert all(torch.equal(v, moments[id(param)][k]) for k, v in state.items())
    assert all(p.grad is None for p in student.parameters())
    assert "nonfinite_step" not in step(examples)  # the next good step is applied again
