"""Rollout dumps of a training run give back the step's metrics; dumping stays within a chunk of memory."""

import json

import numpy as np
import pytest

from opsd.config import load_config


MEMORY_PROBE = """
import resource, sys, torch
from opsd.dumps.record import token_scores
from opsd.sequences import EncodedPrompt, Example
from opsd.scoring import ScoredBatch

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


@pytest.mark.vllm
@pytest.mark.slow
def test_training_dumps_rollouts_that_re_add_to_the_logged_metrics(tmp_path, tiny_vlm_dir, grid_data_dir):
    """The dumped per-token numbers are the step's own: they give back its loss and mismatch."""
    import datasets

    from opsd.train import train

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
        "logging.progress_bar=false", "train.max_steps=2", "rollout.max_new_tokens=16",
        "logging.dump_rollouts_every=1", "logging.dump_top_n=3",
    ])
    out = train(cfg)
    files = sorted((out / "rollouts").glob("*.parquet"))
    assert [f.name for f in files] == ["step_1_rank_0.parquet", "step_2_rank_0.parquet"]
    rows = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                 cache_dir=str(tmp_path / "hf-cache"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]  # after step 0's eval
    assert [m["step"] for m in metrics] == [1, 2]
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
