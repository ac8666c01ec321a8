"""`torchrun --nproc_per_node=2`: FSDP2 on gloo, one in-process vLLM engine per rank, the tiny VLM.

The same global batch trains once on two ranks (one prompt per micro-step each) and once in a single
process (two prompts per micro-step). Prompts are split across ranks in blocks of the global batch
and each prompt's sampling seed is its index in that batch, so both runs sample the same completions
and must agree on the loss, and on the weights they push into their engines. The same holds when the
two ranks form one tensor-parallel engine (vLLM's external launcher) instead of one engine each.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def launch(command, output_dir, tiny_vlm_dir, grid_data_dir, *overrides):
    args = [
        "--config", str(ROOT / "configs/demo.yaml"), f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}",
        f"logging.output_dir={output_dir}", "logging.progress_bar=false", f"train.max_steps={STEPS}",
        "rollout.max_new_tokens=12", "train.grad_accum_steps=2", "optim.warmup_steps=0",
        "optim.schedule=constant", "optim.eps=1e-8", *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = Path(output_dir).with_suffix(".log").open("w")
    return subprocess.Popen([*command, str(ROOT / "tests/helpers/recording_train.py"), *args], env=env, stdout=log, stderr=subprocess.STDOUT)


class Run:
    def __init__(self, process, output_dir):
        self.process, self.output_dir, self.records = process, Path(output_dir), None

    def metrics(self) -> list[dict]:
        """Wait for the run (once) and return its metrics records."""
        if self.records is None:
            try:
                code = self.process.wait(timeout=420)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = "timeout"
            log = self.output_dir.with_suffix(".log").read_text()
            assert code == 0, f"run failed ({code}):\n{log[-6000:]}"
            self.records = [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]
        return self.records

    def pushed(self, rank: int) -> dict[str, torch.Tensor]:
        return load_file(self.output_dir / f"pushed_rank{rank}.safetensors")


def torchrun(output_dir, tiny_vlm_dir, grid_data_dir, *overrides) -> Run:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return Run(launch(command, output_dir, tiny_vlm_dir, grid_data_dir, "train.prompts_per_micro_step=1", *overrides), output_dir)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, tiny_vlm_dir, grid_data_dir) -> Run:
    """The reference: one process, the two ranks' prompts in each micro-step. Started here, awaited by
    the first test that reads it, so that it runs beside that test's torchrun launch."""
    out = tmp_path_factory.mktemp("single") / "run"
    return Run(launch([sys.executable], out, tiny_vlm_dir, grid_data_dir, "train.prompts_per_micro_step=2"), out)


def assert_same_training(dist_records, single_records):
    assert [r["step"] for r in dist_records] == list(range(0, STEPS + 1))  # step 0: the baseline evaluation
    assert dist_records[0]["eval/accuracy"] == single_records[0]["eval/accuracy"]
    dist_records, single_records = dist_records[1:], single_records[1:]
    for d, s in zip(dist_records, single_records):
        assert d["completion_tokens"] == s["completion_tokens"] > 0  # the same completions were sampled
        assert len(d["logprob_mismatch_max_per_rank"]) == 2
        assert max(d["logprob_mismatch_max_per_rank"]) < 1e-3  # every rank's engine got every sync
        assert d["loss"] == pytest.approx(s["loss"], abs=1e-5)
    assert dist_records[-1]["loss"] != pytest.approx(dist_records[0]["loss"], abs=1e-4)  # training moved


def assert_close_weights(pushed, reference):
    assert pushed.keys() == reference.keys()
    # Summation order differs (gradients reduced across ranks), so the gradients agree to float32
    # round-off. Adam scales every element's update to about lr (1e-3) whatever its gradient, so an
    # element whose gradient is itself at round-off level may move differently; those are rare.
    diff = torch.cat([(pushed[name] - reference[name]).abs().flatten() for name in pushed])
    assert diff.max() < 1e-4
    assert (diff > 1e-6).float().mean() < 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_two_ranks_match_a_single_process_on_the_same_global_batch(tmp_path, tiny_vlm_dir, grid_data_dir, single_process):
    run = torchrun(tmp_path / "two-ranks", tiny_vlm_dir, grid_data_dir)
    assert_same_training(run.metrics(), single_process.metrics())
    # Both ranks' engines hold identical full weights, equal to the single-process run's.
    rank0, rank1 = run.pushed(0), run.pushed(1)
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    assert_close_weights(rank0, single_process.pushed(0))
    engines = [json.loads((run.output_dir / f"engine_rank{r}.json").read_text()) for r in (0, 1)]
    assert engines[0] == engines[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_tensor_parallel_engine_over_two_ranks_samples_what_one_engine_would(tmp_path, tiny_vlm_dir, grid_data_dir, single_process):
    """vLLM's external launcher: the two ranks form one engine, each holding half of every layer."""
    run = torchrun(tmp_path / "tp2", tiny_vlm_dir, grid_data_dir, "rollout.tensor_parallel_size=2")
    assert_same_training(run.metrics(), single_process.metrics())
    assert_close_weights(run.pushed(1), single_process.pushed(0))
    engines = [json.loads((run.output_dir / f"engine_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(name.startswith(f"dp0:pp0:pcp0:tp{r}:") for r in (0, 1) for name in engines[r])  # shards
