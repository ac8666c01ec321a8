"""`python -m opsd.rollouts`: offline dumps on the tiny VLM, then analyze with --compare."""

import shutil

import pyarrow.parquet as pq
import pytest
import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.dataset import split_samples
from opsd.dumps.offline import resolve_model_dirs
from opsd.loss import token_logprobs
from opsd.modeling import load_model, load_processor
from opsd.prompts import teacher_prompt
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt
from opsd.train import train
from tests.helpers.runs import demo_config
from opsd.rollouts import main


def test_dump_needs_a_config_or_a_model_and_data(tmp_path, capsys):
    assert main(["dump", "--out", str(tmp_path)]) == 2
    assert "--config, or --model (or --checkpoint) and --data" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
def test_dump_real_and_noise_then_compare(tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    common = [
        "--config", "configs/smoke.yaml", "--num-samples", "2", f"model.path={tiny_vlm_dir}",
        f"data.path={grid_data_dir}", "rollout.max_new_tokens=12",
    ]
    assert main(["dump", *common, "--out", str(tmp_path / "real")]) == 0
    captured = capfd.readouterr()  # the file descriptors: vLLM's native output included
    lines = captured.out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {tmp_path / 'real' / 'step_0_rank_0.parquet'}")
    assert lines[0].endswith(f"; third-party output: {tmp_path / 'real' / 'dump.log'}")
    assert captured.err == "" and "vllm" in (tmp_path / "real" / "dump.log").read_text()
    assert main(["dump", *common, "--out", str(tmp_path / "noise"), "prompts.noise=normal"]) == 0
    real = pq.read_table(tmp_path / "real" / "step_0_rank_0.parquet")
    noise = pq.read_table(tmp_path / "noise" / "step_0_rank_0.parquet")
    assert real.num_rows == noise.num_rows == 4  # 2 prompts x samples_per_prompt 2
    # Same weights and seeds: the same completions, scored by teachers that saw different images.
    assert real["completion_ids"].to_pylist() == noise["completion_ids"].to_pylist()
    assert real["teacher_logprobs"].to_pylist() != noise["teacher_logprobs"].to_pylist()
    assert all(":noise-normal@" in ref for refs in noise["teacher_images"].to_pylist() for ref in refs[1:])
    capfd.readouterr()

    plots = tmp_path / "plots"
    assert main(["analyze", str(tmp_path / "real"), "--compare", str(tmp_path / "noise"), "--out", str(plots)]) == 0
    out = capfd.readouterr().out
    assert "== summary" in out and "real" in out and "noise" in out
    assert "mean divergence by completion position" in out and "positions with the largest divergence" in out
    completions_line = next(line for line in out.splitlines() if line.startswith("completions"))
    assert completions_line.split()[1:] == ["4", "4"]
    assert "paired tokens (noise - real" in out
    assert {p.name for p in plots.glob("*.png")} == {"divergence_by_position.png", "divergence_histogram.png"}


def test_dump_of_a_fixed_teacher_checkpoint_scores_the_teacher_with_the_initial_weights(
    tmp_path, tiny_vlm_dir, grid_data_dir, capsys
):
    """A checkpoint written by the trainer: student from model/, the fixed teacher from the run's model.path."""
    initial = tmp_path / "initial"
    shutil.copytree(tiny_vlm_dir, initial)
    cfg = demo_config(tmp_path, initial, grid_data_dir, "teacher.mode=fixed", "rollout.engine=hf",
                      "train.max_steps=1", "optim.warmup_steps=0", "eval.every=0", "rollout.max_new_tokens=8")
    run_dir = train(cfg)
    checkpoint = run_dir / "checkpoint-1"
    assert not (checkpoint / "teacher").exists()  # a fixed teacher is not saved: it is model.path
    dirs = resolve_model_dirs(run_dir)  # a run directory: its newest checkpoint
    assert (dirs.student, dirs.teacher, dirs.step) == (str(checkpoint / "model"), str(initial), 1)

    args = ["dump", "--config", "configs/smoke.yaml", "--checkpoint", str(checkpoint), f"data.path={grid_data_dir}",
            "--num-samples", "2", "--out", str(tmp_path / "dump"), "rollout.engine=hf", "rollout.max_new_tokens=8"]
    assert main(args) == 0
    rows = pq.read_table(tmp_path / "dump" / "step_1_rank_0.parquet").to_pylist()
    assert len(rows) == 4  # 2 prompts x samples_per_prompt 2

    # The teacher's logprobs are those of the initial weights on the teacher prompt, not the trained student's.
    processor = load_processor(ModelConfig(path=str(initial)))
    samples = {s.id: s for s in split_samples(cfg, 2, split="train")[0]}
    models = {name: load_model(ModelConfig(path=str(path)), processor, torch.device("cpu"))
              for name, path in (("initial", initial), ("trained", checkpoint / "model"))}
    for row in rows:
        prompt = encode_prompt(processor, teacher_prompt(samples[row["sample_id"]], processor, PromptConfig()))
        batch = collate([prompt], [row["completion_ids"]], processor.tokenizer.pad_token_id)
        with torch.no_grad():
            lp = {name: token_logprobs(completion_logits(m, batch), batch.completion_ids) for name, m in models.items()}
        dumped = torch.tensor(row["teacher_logprobs"])
        assert (dumped - lp["initial"]).abs().max() < 1e-4
        assert (dumped - lp["trained"]).abs().max() > 1e-3  # the check above can fail

    # Without the initial weights the command stops and says why, instead of using the student.
    initial.rename(tmp_path / "moved")
    assert main([*args[:-4], "--out", str(tmp_path / "dump2"), *args[-2:]]) == 2
    err = capsys.readouterr().err
    assert "teacher.mode=fixed" in err and str(initial) in err
    assert not (tmp_path / "dump2").exists()


def test_dump_needs_an_opsd_checkpoint(tmp_path, grid_data_dir, capsys):
    (tmp_path / "checkpoint-3" / "student").mkdir(parents=True)  # another trainer's layout is not guessed at
    args = ["dump", "--checkpoint", str(tmp_path / "checkpoint-3"), "--data", str(grid_data_dir), "--out", str(tmp_path / "d")]
    assert main(args) == 2
    assert "opsd_checkpoint.json" in capsys.readouterr().err
