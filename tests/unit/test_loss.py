"""Tests of opsd.loss against a plain float64 reference, plus properties and gradients."""

import pytest
import torch
import torch.nn.functional as F

import opsd.loss
from opsd.loss import GuardrailSums, generalized_jsd, guardrail_sums, tinker_loss


def ref_jsd(s, t, beta=0.5, temperature=1.0, top_k=0, token_clip=0.0, clip_mode="entry"):
    """Row by row in float64, straight from the definition (mixture in probability space)."""
    s, t = s.double(), t.double().detach()
    out = []
    for si, ti in zip(s, t):
        if 0 < top_k < len(ti):
            idx = torch.argsort(ti, descending=True)[:top_k]
            si, ti = si[idx], ti[idx]
        ps, pt = torch.softmax(si / temperature, 0), torch.softmax(ti / temperature, 0)
        if beta == 0:
            terms = pt * (pt.log() - ps.log())
        elif beta == 1:
            terms = ps * (ps.log() - pt.log())
        else:
            m = (1 - beta) * ps + beta * pt
            terms = beta * pt * (pt.log() - m.log()) + (1 - beta) * ps * (ps.log() - m.log())
        if token_clip > 0 and clip_mode == "entry":
            terms = terms.clamp(max=token_clip)
        value = terms.sum()
        if token_clip > 0 and clip_mode == "token":
            value = value.clamp(max=token_clip)
        out.append(value * temperature**2)
    return torch.stack(out)


def ref_tinker(s, t, ids, temperature=1.0):
    lp_s = torch.log_softmax(s.double() / temperature, -1)[torch.arange(len(ids)), ids]
    lp_t = torch.log_softmax(t.double() / temperature, -1)[torch.arange(len(ids)), ids]
    return -(lp_t - lp_s).detach() * lp_s


def logits(n, v, seed, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)


def distinct_logits(n, v, seed):
    """Rows of distinct multiples of 1/16, exact in bf16, so top-k has no ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([(torch.randperm(v, generator=g) - v / 2) / 16 for _ in range(n)]).float()


CONFIGS = [
    dict(beta=beta, temperature=temperature, top_k=top_k, token_clip=clip, clip_mode=mode)
    for beta in (0.0, 0.3, 0.5, 1.0)
    for temperature in (1.0, 0.7, 2.0)
    for top_k in (0, 5, 64)  # 64 >= V: full vocabulary
    for clip, mode in ((0.0, "entry"), (0.02, "entry"), (0.1, "token"))
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_reference_fp32(cfg):
    s, t = logits(6, 40, 0), logits(6, 40, 1)
    expected = ref_jsd(s, t, **cfg).float()
    torch.testing.assert_close(generalized_jsd(s, t, **cfg), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cfg", CONFIGS[::5], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_reference_bf16(cfg):
    s, t = logits(6, 48, 2, dtype=torch.bfloat16), distinct_logits(6, 48, 3).bfloat16()
    out = generalized_jsd(s, t, **cfg)
    assert out.dtype == torch.float32 and out.shape == (6,)
    torch.testing.assert_close(out, ref_jsd(s, t, **cfg).float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 5])
def test_chunking_does_not_change_values_or_grads(top_k):
    s, t = logits(11, 30, 4).requires_grad_(), logits(11, 30, 5)
    results = []
    for chunk_size in (3, 1024):
        s.grad = None
        out = generalized_jsd(s, t, top_k=top_k, token_clip=0.05, chunk_size=chunk_size)
        (out * torch.arange(11)).sum().backward()
        results.append((out.detach(), s.grad.clone()))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_no_grad_and_fp16_paths():
    s, t = logits(5, 30, 6), logits(5, 30, 7)
    with torch.no_grad():
        out = generalized_jsd(s.requires_grad_(), t)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref_jsd(s, t).float())
    half = generalized_jsd(s.detach().half(), t.half(), top_k=5)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, ref_jsd(s.half(), t.half(), top_k=5).float(), rtol=1e-4, atol=1e-6)
    assert generalized_jsd(torch.empty(0, 4), torch.empty(0, 4)).shape == (0,)


def test_non_contiguous_inputs():
    s, t = logits(40, 12, 27).T, logits(40, 12, 28).T  # [12, 40] views with strides (1, 12)
    for top_k in (0, 5):
        expected = ref_jsd(s, t, top_k=top_k).float()
        torch.testing.assert_close(generalized_jsd(s, t, top_k=top_k, chunk_size=5), expected)


# properties


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 5])
def test_zero_on_identical_distributions(beta, top_k):
    s = logits(8, 50, 8)
    assert generalized_jsd(s, s.clone(), beta=beta, top_k=top_k).abs().max() < 1e-6


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("clip", [dict(), dict(token_clip=0.02), dict(token_clip=0.05, clip_mode="token")])
def test_identical_rows_give_exactly_zero_gradient(beta, top_k, clip):
    """A teacher scoring exactly as the student (its prompt and weights) teaches nothing: its rows'
    gradient is 0, not autograd's round-off, which Adam would scale up to full-size steps."""
    s = logits(8, 50, 8).requires_grad_()
    t = s.detach().clone()
    t[:2] += logits(2, 50, 9)  # two rows differ: their gradient stays the reference's
    loss = generalized_jsd(s, t, beta=beta, top_k=top_k, **clip)
    loss.sum().backward()
    assert torch.equal(loss[2:], torch.zeros(6)) and torch.equal(s.grad[2:], torch.zeros(6, 50))
    reference = s.detach().double().requires_grad_()
    ref_jsd(reference, t, beta=beta, top_k=top_k, **clip).sum().backward()
    torch.testing.assert_close(s.grad[:2], reference.grad[:2].float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("clip", [dict(), dict(token_clip=0.05, clip_mode="token")])
def test_non_negative(beta, clip):
    s, t = logits(20, 50, 9, scale=4), logits(20, 50, 10, scale=4)
    for top_k in (0, 5):
        assert generalized_jsd(s, t, beta=beta, top_k=top_k, **clip).min() >= -1e-6


def test_symmetric_at_half():
    s, t = logits(8, 50, 11), logits(8, 50, 12)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.5), generalized_jsd(t, s, beta=0.5))


def test_beta_0_and_1_are_forward_and_reverse_kl():
    s, t = logits(8, 50, 13), logits(8, 50, 14)
    log_s, log_t = F.log_softmax(s, -1), F.log_softmax(t, -1)
    kl_ts = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)  # KL(teacher || student)
    kl_st = F.kl_div(log_t, log_s, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.0), kl_ts)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1.0), kl_st)


def test_clip_bounds():
    s, t = logits(30, 50, 15, scale=5), logits(30, 50, 16, scale=5)
    unclipped = generalized_jsd(s, t, top_k=8)
    entry = generalized_jsd(s, t, top_k=8, token_clip=0.01)
    token = generalized_jsd(s, t, top_k=8, token_clip=0.01, clip_mode="token")
    assert (entry <= 8 * 0.01 + 1e-6).all() and (token <= 0.01 + 1e-6).all()
    assert (unclipped > 8 * 0.01).any()  # the bounds were binding
    assert (entry > 0.01).any()  # elementwise clipping lets a token exceed the per-entry cap
    assert (generalized_jsd(s, t, token_clip=0.01) <= 50 * 0.01 + 1e-6).all()


# gradients


GRAD_CONFIGS = [
    dict(beta=0.5),
    dict(beta=0.0, top_k=3),
    dict(beta=1.0, temperature=0.7),
    dict(beta=0.5, top_k=4, temperature=2.0, token_clip=0.02),
    dict(beta=0.3, token_clip=0.1, clip_mode="token"),
    dict(beta=0.0, token_clip=0.03),
]


@pytest.mark.parametrize("cfg", GRAD_CONFIGS, ids=str)
def test_gradcheck(cfg):
    # Fixed seeds keep every clipped quantity far (>> eps) from the clamp's kink.
    s = logits(3, 7, 17, dtype=torch.float64).requires_grad_()
    t = logits(3, 7, 18, dtype=torch.float64)
    if cfg.get("token_clip"):  # the clip must actually bind somewhere for the check to mean something
        assert not torch.allclose(ref_jsd(s, t, **cfg), ref_jsd(s, t, **{**cfg, "token_clip": 0.0}))
    assert torch.autograd.gradcheck(lambda x: generalized_jsd(x, t, chunk_size=2, **cfg), (s,))


@pytest.mark.parametrize("cfg", GRAD_CONFIGS, ids=str)
def test_grad_matches_reference_and_teacher_gets_none(cfg):
    s = logits(9, 40, 19).requires_grad_()
    t = logits(9, 40, 20).requires_grad_()
    w = torch.rand(9, generator=torch.Generator().manual_seed(0))
    (generalized_jsd(s, t, chunk_size=4, **cfg) * w).sum().backward()
    s64 = s.detach().double().requires_grad_()
    (ref_jsd(s64, t, **cfg) * w.double()).sum().backward()
    torch.testing.assert_close(s.grad, s64.grad.float(), rtol=1e-4, atol=1e-6)
    assert t.grad is None


def test_bf16_grad_has_input_dtype():
    s = logits(4, 30, 21, dtype=torch.bfloat16).requires_grad_()
    generalized_jsd(s, logits(4, 30, 22, dtype=torch.bfloat16), top_k=5).sum().backward()
    assert s.grad.dtype == torch.bfloat16 and s.grad.shape == s.shape


# tinker


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tinker_values_and_grad(monkeypatch, temperature):
    monkeypatch.setattr(opsd.loss, "LOGPROB_CHUNK_ROWS", 3)  # exercise chunking on a small N
    s = logits(7, 20, 23).requires_grad_()
    t = logits(7, 20, 24).requires_grad_()
    ids = torch.randint(0, 20, (7,), generator=torch.Generator().manual_seed(1))
    out = tinker_loss(s, t, ids, temperature=temperature)
    torch.testing.assert_close(out, ref_tinker(s, t, ids, temperature).float())
    out.sum().backward()
    # d/ds log p_S(y) = (onehot(y) - softmax(s / T)) / T
    log_p_s = torch.log_softmax(s.detach().double() / temperature, -1)
    log_p_t = torch.log_softmax(t.detach().double() / temperature, -1)
    advantage = (log_p_t - log_p_s)[torch.arange(7), ids]
    grad_log_p = (F.one_hot(ids, 20) - log_p_s.exp()) / temperature
    torch.testing.assert_close(s.grad, (-advantage[:, None] * grad_log_p).float())
    assert t.grad is None


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_tinker_importance_weight(temperature):
    """The ratio compares raw logprobs (the engine's are at T=1) whatever the loss temperature."""
    s = logits(6, 20, 25, dtype=torch.float64).requires_grad_()  # float64: 1e-6 is far above rounding
    t = logits(6, 20, 26, dtype=torch.float64)
    ids = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(2))
    own = torch.log_softmax(s.detach(), -1)[torch.arange(6), ids]  # the student's raw logprobs
    plain_loss = tinker_loss(s, t, ids, temperature=temperature)
    (plain,) = torch.autograd.grad(plain_loss.sum(), s)
    same_loss = tinker_loss(s, t, ids, temperature=temperature, sampler_logprobs=own)
    (same,) = torch.autograd.grad(same_loss.sum(), s)
    # sampler == student weights: ratio 1, the plain gradient (and value)
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(same_loss, plain_loss, atol=1e-6, rtol=0)
    lagging = own + torch.linspace(-0.5, 0.5, 6)
    (weighted,) = torch.autograd.grad(tinker_loss(s, t, ids, temperature=temperature, sampler_logprobs=lagging).sum(), s)
    ratio = torch.exp(own - lagging)
    torch.testing.assert_close(weighted, ratio[:, None] * plain)


# argument validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(beta=-0.1), "beta"),
        (dict(beta=1.5), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(token_clip=-0.1), "token_clip"),
        (dict(clip_mode="row"), "clip_mode"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_jsd_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generalized_jsd(torch.zeros(2, 5), torch.zeros(2, 5), **kwargs)


def test_bad_shapes():
    with pytest.raises(ValueError, match="student_logits"):
        generalized_jsd(torch.zeros(5), torch.zeros(5))
    with pytest.raises(ValueError, match="teacher_logits"):
        generalized_jsd(torch.zeros(2, 5), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="teacher_logits"):
        tinker_loss(torch.zeros(2, 5), torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(
    "ids, kwargs, name",
    [
        (torch.zeros(3, dtype=torch.long), {}, "sampled_ids"),
        (torch.zeros(2), {}, "sampled_ids"),
        (torch.tensor([0, 5]), {}, "sampled_ids"),
        (torch.tensor([0, -1]), {}, "sampled_ids"),
        (torch.tensor([0, 1]), dict(temperature=-1.0), "temperature"),
        (torch.tensor([0, 1]), dict(sampler_logprobs=torch.zeros(3)), "sampler_logprobs"),
    ],
)
def test_tinker_bad_arguments(ids, kwargs, name):
    with pytest.raises(ValueError, match=name):
        tinker_loss(torch.zeros(2, 5), torch.zeros(2, 5), ids, **kwargs)


# guardrail metrics


def ref_terms(s, t, beta, temperature, top_k):
    """Per-entry divergence terms [N, k] on the teacher's top-k, float64, from the definition."""
    idx = t.topk(top_k, dim=-1).indices if top_k else torch.arange(t.shape[-1]).expand(t.shape)
    s, t = s.double().gather(-1, idx), t.double().gather(-1, idx)
    ps, pt = torch.softmax(s / temperature, -1), torch.softmax(t / temperature, -1)
    m = (1 - beta) * ps + beta * pt
    return beta * pt * (pt.log() - m.log()) + (1 - beta) * ps * (ps.log() - m.log())


@pytest.mark.parametrize("clip_mode", ["entry", "token"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_guardrail_sums_against_definitions(clip_mode, temperature):
    s, t = logits(9, 40, 31), logits(9, 40, 32)
    clip = 0.01 if clip_mode == "entry" else 0.2
    sums = guardrail_sums(s, t, beta=0.5, temperature=temperature, top_k=6, token_clip=clip,
                          clip_mode=clip_mode, chunk_size=4)
    probs = torch.softmax(t.double() / temperature, -1)
    assert sums.tokens == 9
    assert sums.teacher_topk_mass == pytest.approx(probs.topk(6, -1).values.sum().item(), rel=1e-5)
    entropy = torch.distributions.Categorical(logits=s.double()).entropy().sum().item()
    assert sums.student_entropy == pytest.approx(entropy, rel=1e-5)
    terms = ref_terms(s, t, 0.5, temperature, 6)
    if clip_mode == "token":
        terms = terms.sum(-1)
    assert sums.clip_candidates == terms.numel()
    assert 0 < sums.clipped < terms.numel()  # some clipped, some not: the count can be wrong
    assert sums.clipped == (terms > clip).sum().item()
    metrics = sums.metrics()
    assert metrics["clip_fraction"] == pytest.approx((terms > clip).double().mean().item())
    assert metrics["teacher_topk_mass"] == pytest.approx(sums.teacher_topk_mass / 9)


def test_guardrail_sums_without_top_k_or_clip_and_added_up():
    s, t = logits(5, 30, 33), logits(5, 30, 34)
    sums = guardrail_sums(s, t, top_k=0, token_clip=0.0)
    assert sums.teacher_topk_mass == 5 and sums.clip_candidates == 0 and sums.metrics()["clip_fraction"] == 0
    student_only = guardrail_sums(s, None, top_k=4, token_clip=0.05)  # no teacher: the student's entropy alone
    assert student_only.clip_candidates == 0 and student_only.teacher_topk_mass == 5
    assert student_only.student_entropy == pytest.approx(guardrail_sums(s, t).student_entropy)
    total = GuardrailSums()
    total.add(guardrail_sums(s[:2], t[:2], top_k=4, token_clip=0.05))
    total.add(guardrail_sums(s[2:], t[2:], top_k=4, token_clip=0.05))
    whole = guardrail_sums(s, t, top_k=4, token_clip=0.05)
    for name, value in vars(whole).items():
        assert getattr(total, name) == pytest.approx(value, rel=1e-6)
