"""`torchrun --nproc_per_node=2`: FSDP2 on gloo, one in-process vLLM engine per rank, the tiny VLM.

The same global batch trains once on two ranks (one prompt per micro-step each) and once in a single
process (two prompts per micro-step). Prompts are split across ranks in blocks of the global batch
and each prompt's sampling seed is its index in that batch, so both runs sample the same completions
and must agree on the loss, and on the weights they push into their engines.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def launch(command, output_dir, tiny_vlm_dir, grid_data_dir, *overrides):
    args = [
        "--config", str(ROOT / "configs/demo.yaml"), f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}",
        f"logging.output_dir={output_dir}", "logging.progress_bar=false", f"train.max_steps={STEPS}",
        "rollout.max_new_tokens=12", "train.grad_accum_steps=2", "optim.warmup_steps=0",
        "optim.schedule=constant", "optim.eps=1e-8", *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = open(Path(output_dir).with_suffix(".log"), "w")
    return subprocess.Popen([*command, str(ROOT / "tests/recording_train.py"), *args], env=env, stdout=log, stderr=subprocess.STDOUT)


def wait(process, output_dir):
    try:
        code = process.wait(timeout=420)
    except subprocess.TimeoutExpired:
        process.kill()
        code = "timeout"
    assert code == 0, f"run failed ({code}):\n" + Path(output_dir).with_suffix(".log").read_text()[-6000:]
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.vllm
@pytest.mark.slow
def test_two_ranks_match_a_single_process_on_the_same_global_batch(tmp_path, tiny_vlm_dir, grid_data_dir):
    dist_dir, single_dir = tmp_path / "two-ranks", tmp_path / "single"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # Both runs at once: each is mostly single-threaded start-up.
    dist_run = launch(torchrun, dist_dir, tiny_vlm_dir, grid_data_dir, "train.prompts_per_micro_step=1")
    single_run = launch([sys.executable], single_dir, tiny_vlm_dir, grid_data_dir, "train.prompts_per_micro_step=2")
    dist_records, single_records = wait(dist_run, dist_dir), wait(single_run, single_dir)

    assert [r["step"] for r in dist_records] == list(range(1, STEPS + 1))
    for d, s in zip(dist_records, single_records):
        assert d["completion_tokens"] == s["completion_tokens"] > 0  # the same completions were sampled
        assert len(d["logprob_mismatch_max_per_rank"]) == 2
        assert max(d["logprob_mismatch_max_per_rank"]) < 1e-3  # every rank's engine got every sync
        assert d["loss"] == pytest.approx(s["loss"], abs=1e-5)
    assert dist_records[-1]["loss"] != pytest.approx(dist_records[0]["loss"], abs=1e-4)  # training moved

    # Both ranks' engines hold identical full weights, equal to the single-process run's.
    rank0, rank1 = (load_file(dist_dir / f"pushed_rank{r}.safetensors") for r in (0, 1))
    single = load_file(single_dir / "pushed_rank0.safetensors")
    assert rank0.keys() == rank1.keys() == single.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    # Summation order differs (gradients reduced across ranks), so the gradients agree to float32
    # round-off. Adam scales every element's update to about lr (1e-3) whatever its gradient, so an
    # element whose gradient is itself at round-off level may move differently; those are rare.
    diff = torch.cat([(rank0[name] - single[name]).abs().flatten() for name in rank0])
    assert diff.max() < 1e-4
    assert (diff > 1e-6).float().mean() < 1e-3
    assert json.loads((dist_dir / "engine_rank0.json").read_text()) == json.loads((dist_dir / "engine_rank1.json").read_text())
