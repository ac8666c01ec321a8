"""Rollout dumps: answer checks, per-token records, and a training run that writes them."""

import json

import numpy as np
import pytest
import torch

from opsd.config import load_config
from opsd.rollout.dumps import (
    answer_is_correct, extract_answer, recorder_for_step, teacher_top_n, token_scores,
)
from opsd.sequences import EncodedPrompt, Example
from opsd.trainer.step import ScoredBatch


def test_answer_extraction_takes_the_last_tag_and_normalises():
    assert extract_answer("<think>maybe <answer>2</answer></think> <answer> Left. </answer>") == "Left."
    assert extract_answer("no tag here") is None
    assert answer_is_correct("<answer> Left. </answer>", "left") is True
    assert answer_is_correct("<answer>right</answer>", "left") is False
    assert answer_is_correct("left", "left") is False  # no <answer>: not counted as correct
    assert answer_is_correct("<answer>left</answer>", None) is None


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


MEMORY_PROBE = """
import resource, sys, torch
from opsd.rollout.dumps import token_scores
from opsd.sequences import EncodedPrompt, Example
from opsd.trainer.step import ScoredBatch

n, v, chunk = 2048, 32768, 128
logits = [torch.randn(n, v, dtype=torch.bfloat16) for _ in range(2)]  # student, teacher
micro = [Example(str(i), EncodedPrompt([0]), EncodedPrompt([0]), [1] * 256, [0.0] * 256) for i in range(n // 256)]
scored = ScoredBatch(torch.randint(0, v, (n,)), torch.zeros(n), *logits, torch.zeros(n), torch.zeros(n))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
token_scores(micro, scored, top_n=8, chunk_size=chunk)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_per_token_records_stay_within_a_chunk_of_memory():
    """Issue: dumping top-n never materialises more than the logits the step already holds. The
    growth is bounded by float32 [chunk, V] working copies (~3 here), not by [N, V].

    A fixed glibc mmap threshold makes every chunk-sized buffer its own mapping, so peak RSS counts
    live tensors only; with the default dynamic threshold the heap may keep freed chunks and peak
    RSS then also counts allocator caching (seen: up to N x V float32, for the step's own chunked
    token_logprobs as much as for the dump's).
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, check=True, env=env)
    growth = int(out.stdout.strip().splitlines()[-1])
    chunk_f32_bytes = 128 * 32768 * 4
    assert growth < 4 * chunk_f32_bytes  # 64 MiB; the bf16 teacher logits are 128 MiB, a float32 copy 256 MiB


def test_recorder_only_on_dump_steps():
    base = ["model.path=m", "data.path=d"]
    assert recorder_for_step(load_config("configs/demo.yaml", base), 4) is None  # off by default
    cfg = load_config("configs/demo.yaml", [*base, "logging.dump_rollouts_every=2"])
    assert recorder_for_step(cfg, 3) is None and recorder_for_step(cfg, 4) is not None


@pytest.mark.vllm
def test_training_dumps_rollouts_that_re_add_to_the_logged_metrics(tmp_path, tiny_vlm_dir, grid_data_dir):
    """The dumped per-token numbers are the step's own: they give back its loss and mismatch."""
    import datasets

    from opsd.train import train

    cfg = load_config("configs/demo.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
        "logging.progress_bar=false", "train.max_steps=2", "rollout.max_new_tokens=16",
        "logging.dump_rollouts_every=1", "logging.dump_top_n=3",
    ])
    out = train(cfg)
    files = sorted((out / "rollouts").glob("*.parquet"))
    assert [f.name for f in files] == ["step_1_rank_0.parquet", "step_2_rank_0.parquet"]
    rows = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                 cache_dir=str(tmp_path / "hf-cache"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        step_rows = [r for r in rows if r["step"] == m["step"]]
        assert len(step_rows) == cfg.train.prompts_per_micro_step * cfg.train.grad_accum_steps * cfg.rollout.samples_per_prompt
        divergence = np.concatenate([np.asarray(r["divergence"], np.float32) for r in step_rows])
        assert divergence.size == m["completion_tokens"]
        assert divergence.sum(dtype=np.float64) / divergence.size == pytest.approx(m["jsd"], rel=1e-5)
        mismatch = np.concatenate([
            np.abs(np.asarray(r["student_logprobs"], np.float32) - np.asarray(r["engine_logprobs"], np.float32))
            for r in step_rows
        ])
        assert float(mismatch.max()) == m["logprob_mismatch_max"]
        assert mismatch.mean(dtype=np.float64) == pytest.approx(m["logprob_mismatch_mean"], rel=1e-5)
        for r in step_rows:
            n = r["num_tokens"]
            assert len(r["completion_ids"]) == len(r["completion_tokens"]) == len(r["teacher_logprobs"]) == n
            assert len(r["teacher_top_ids"]) == n and all(len(top) == 3 for top in r["teacher_top_probs"])
            assert r["answer"] and r["correct"] in (True, False)
            assert r["images"][0].startswith(f"{r['sample_id']}/images/0@sha256:")
            assert any("/privileged_images/" in ref for ref in r["teacher_images"])
            assert cfg.prompts.reference_intro in r["teacher_prompt"] and cfg.prompts.reference_intro not in r["prompt"]
