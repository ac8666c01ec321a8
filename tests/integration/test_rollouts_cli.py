"""`python -m opsd.rollouts`: offline dumps on the tiny VLM, then analyze with --compare."""

import shutil

import pyarrow.parquet as pq
import pytest

from opsd.dumps.offline import resolve_model_dirs
from opsd.rollouts import main


def test_checkpoint_directories_resolve(tmp_path, tiny_vlm_dir):
    assert resolve_model_dirs(tiny_vlm_dir).student == str(tiny_vlm_dir)
    ckpt = tmp_path / "checkpoint-12"
    (ckpt / "student").mkdir(parents=True)
    (ckpt / "student" / "config.json").write_text("{}")
    dirs = resolve_model_dirs(ckpt)
    assert (dirs.student, dirs.teacher, dirs.step) == (str(ckpt / "student"), None, 12)
    (ckpt / "teacher").mkdir()
    (ckpt / "teacher" / "config.json").write_text("{}")
    assert resolve_model_dirs(ckpt).teacher == str(ckpt / "teacher")
    with pytest.raises(FileNotFoundError, match="checkpoint-12/student"):
        resolve_model_dirs(ckpt / "student" / "missing")


def test_dump_needs_a_config_or_a_model_and_data(tmp_path, capsys):
    assert main(["dump", "--out", str(tmp_path)]) == 2
    assert "--config, or --model (or --checkpoint) and --data" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
def test_dump_real_and_noise_then_compare(tmp_path, tiny_vlm_dir, grid_data_dir, capsys):
    common = [
        "--config", "configs/demo.yaml", "--num-samples", "2", f"model.path={tiny_vlm_dir}",
        f"data.path={grid_data_dir}", "rollout.max_new_tokens=12",
    ]
    assert main(["dump", *common, "--out", str(tmp_path / "real")]) == 0
    assert main(["dump", *common, "--out", str(tmp_path / "noise"), "prompts.noise_privileged_images=true"]) == 0
    real = pq.read_table(tmp_path / "real" / "step_0_rank_0.parquet")
    noise = pq.read_table(tmp_path / "noise" / "step_0_rank_0.parquet")
    assert real.num_rows == noise.num_rows == 4  # 2 prompts x samples_per_prompt 2
    # Same weights and seeds: the same completions, scored by teachers that saw different images.
    assert real["completion_ids"].to_pylist() == noise["completion_ids"].to_pylist()
    assert real["teacher_logprobs"].to_pylist() != noise["teacher_logprobs"].to_pylist()
    assert all(":noise@" in ref for refs in noise["teacher_images"].to_pylist() for ref in refs[1:])
    capsys.readouterr()

    plots = tmp_path / "plots"
    assert main(["analyze", str(tmp_path / "real"), "--compare", str(tmp_path / "noise"), "--out", str(plots)]) == 0
    out = capsys.readouterr().out
    assert "== summary" in out and "real" in out and "noise" in out
    assert "mean divergence by completion position" in out and "positions with the largest divergence" in out
    completions_line = next(line for line in out.splitlines() if line.startswith("completions"))
    assert completions_line.split()[1:] == ["4", "4"]
    assert "paired tokens (noise - real" in out
    assert {p.name for p in plots.glob("*.png")} == {"divergence_by_position.png", "divergence_histogram.png"}


def test_dump_from_a_checkpoint_directory_without_config(tmp_path, tiny_vlm_dir, grid_data_dir, capsys):
    """A model directory alone (here inside a checkpoint-{step} layout), default config, HF engine."""
    shutil.copytree(tiny_vlm_dir, tmp_path / "checkpoint-3" / "student")
    args = [
        "dump", "--checkpoint", str(tmp_path / "checkpoint-3"), "--data", str(grid_data_dir), "--split", "eval",
        "--num-samples", "1", "--out", str(tmp_path / "dump"), "rollout.engine=hf", "rollout.max_new_tokens=6",
    ]
    assert main(args) == 0
    table = pq.read_table(tmp_path / "dump" / "step_3_rank_0.parquet")
    assert table.num_rows == 1 and table["sample_id"][0].as_py().startswith("grid-")
    assert "teacher_top_ids" in table.column_names  # logging.dump_top_n defaults to 5
    assert main(["analyze", str(tmp_path / "dump")]) == 0
    assert (tmp_path / "dump" / "plots" / "divergence_by_position.png").is_file()
