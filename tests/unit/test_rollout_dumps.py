"""Rollout dumps: answer checks, per-token records, the file name, which steps dump."""

import numpy as np
import pytest
import torch

from opsd.config import load_config
from opsd.data.sample import Sample
from opsd.dumps.record import (
    TokenScores, answer_is_correct, extract_answer, recorder_for, recorder_for_step, rollout_rows, teacher_top_n,
    token_scores,
)
from opsd.sequences import EncodedPrompt, Example
from opsd.scoring import ScoredBatch


def test_answer_extraction_takes_the_last_tag_and_normalises():
    assert extract_answer("<think>maybe <answer>2</answer></think> <answer> Left. </answer>") == "Left."
    assert extract_answer("no tag here") is None
    assert answer_is_correct("<answer> Left. </answer>", "left") is True
    assert answer_is_correct("<answer>right</answer>", "left") is False
    assert answer_is_correct("left", "left") is False  # no <answer>: not counted as correct
    assert answer_is_correct("<answer>left</answer>", None) is None


def test_dumps_judge_answers_with_the_runs_answer_pattern(tiny_text_dir):
    """The SmolLM2 recipe answers "The answer is N."; its dumps must count that as eval does."""
    from opsd.config import ModelConfig
    from opsd.modeling import load_processor

    cfg = load_config("configs/text_opsd_smollm2.yaml")
    recorder = recorder_for(cfg)
    assert recorder.answer_pattern == cfg.eval.answer_pattern
    tokenizer = load_processor(ModelConfig(path=str(tiny_text_dir)))
    ids = tokenizer("So 12 + 30 = 42. The answer is 42.", add_special_tokens=False)["input_ids"]
    sample = Sample(id="s", question="What is 12 + 30?", images=[], privileged_images=[], answer="42")
    example = Example("s", EncodedPrompt([1]), EncodedPrompt([1]), ids, [0.0] * len(ids))
    scores = TokenScores(*(np.zeros(len(ids), np.float32) for _ in range(4)))
    (row,) = rollout_rows(1, 0, [example], [scores], [sample], tokenizer, cfg.prompts, recorder.answer_pattern)
    assert row["correct"] is True and row["predicted_answer"] == "42"
    (default,) = rollout_rows(1, 0, [example], [scores], [sample], tokenizer, cfg.prompts)
    assert default["correct"] is False  # the `<answer>` pattern would not find it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_teacher_top_n_matches_the_full_softmax(dtype):
    logits = torch.randn(7, 50).to(dtype)
    ids, probs = teacher_top_n(logits, 4, chunk_size=3)
    full = torch.softmax(logits.float(), dim=-1)
    expected_probs, expected_ids = full.topk(4, dim=-1)
    assert ids.shape == (7, 4) and probs.dtype == torch.float32
    torch.testing.assert_close(full.gather(-1, ids), expected_probs)  # ties in bf16 may swap ids
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)


def test_token_scores_split_a_micro_batch_per_completion():
    prompt = EncodedPrompt([1, 2])
    micro = [Example("a", prompt, prompt, [5, 6, 7], [-1.0] * 3), Example("b", prompt, prompt, [8, 9], [-2.0] * 2)]
    n, v = 5, 12
    teacher = torch.randn(n, v)
    sampled = torch.tensor([5, 6, 7, 8, 9])
    scored = ScoredBatch(
        sampled_ids=sampled, engine_logprobs=torch.tensor([-1.0, -1.0, -1.0, -2.0, -2.0]),
        student_logits=torch.randn(n, v, requires_grad=True), teacher_logits=teacher,
        distill=torch.arange(n, dtype=torch.float32).requires_grad_(), student_logprobs=torch.full((n,), -3.0),
    )
    a, b = token_scores(micro, scored, top_n=2, chunk_size=2)
    assert a.divergence.tolist() == [0, 1, 2] and b.divergence.tolist() == [3, 4]
    assert b.engine_logprobs.tolist() == [-2.0, -2.0] and a.student_logprobs.dtype == np.float32
    teacher_lp = torch.log_softmax(teacher, -1)[torch.arange(n), sampled].numpy()
    np.testing.assert_allclose(np.concatenate([a.teacher_logprobs, b.teacher_logprobs]), teacher_lp, rtol=1e-5)
    assert a.teacher_top_ids.shape == (3, 2) and b.teacher_top_probs.shape == (2, 2)
    assert token_scores(micro, scored, top_n=0, chunk_size=2)[0].teacher_top_ids is None


def test_recorder_only_on_dump_steps():
    base = ["model.path=m", "data.path=d"]
    assert recorder_for_step(load_config("configs/smoke.yaml", base), 4) is None  # off by default
    cfg = load_config("configs/smoke.yaml", [*base, "logging.dump_rollouts_every=2"])
    assert recorder_for_step(cfg, 3) is None and recorder_for_step(cfg, 4) is not None


def test_every_loss_kind_dumps_in_its_own_row_chunks():
    base = ["model.path=m", "data.path=d", "logging.dump_rollouts_every=1", "prompts.privileged=[text]"]
    assert recorder_for_step(load_config("configs/smoke.yaml", [*base, "loss.chunk_size=7"]), 1).chunk_size == 7
    for kind in ("tinker", "sft"):  # no chunk_size setting: the rows their token logprobs take at once
        assert recorder_for_step(load_config("configs/smoke.yaml", [*base, f"loss={{kind: {kind}}}"]), 1).chunk_size == 1024
