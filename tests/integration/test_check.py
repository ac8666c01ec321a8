"""`python -m opsd.train --check`: the self-test passes on a working setup and catches a broken sync."""

import pytest

from opsd.train import main


def check_args(tmp_path, tiny_vlm_dir, grid_data_dir, *overrides):
    return ["--config", "configs/smoke.yaml", "--check", f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}",
            f"logging.output_dir={tmp_path / 'run'}", "rollout.max_new_tokens=16", *overrides]


@pytest.mark.vllm
def test_check_passes_on_the_demo_config_with_vllm(tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    assert main(check_args(tmp_path, tiny_vlm_dir, grid_data_dir)) == 0
    captured = capfd.readouterr()  # the file descriptors: vLLM's native output included
    out = captured.out
    assert "check 1, no privileged information" in out and ": ok" in out
    assert "check 2, with privileged images" in out and "check passed" in out
    # The console holds the checks alone; vLLM's and transformers' output is in check.log, the only file written.
    assert [line.split(",")[0].split(" (")[0] for line in out.splitlines()] == ["check 1", "check 2", "check 3", "check passed"]
    assert captured.err == ""
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["check.log"]
    assert "vllm" in (tmp_path / "run" / "check.log").read_text()


def test_check_fails_when_the_engine_does_not_follow_the_weights(tmp_path, tiny_vlm_dir, grid_data_dir, capsys, monkeypatch):
    from opsd.rollout.hf_engine import HFEngine

    monkeypatch.setattr(HFEngine, "receive_weights", lambda self, bucket: None)
    assert main(check_args(tmp_path, tiny_vlm_dir, grid_data_dir, "rollout.engine=hf")) == 1
    out = capsys.readouterr().out
    assert "check 1" in out and "check 3" in out and "check FAILED" in out
    check1 = next(line for line in out.splitlines() if line.startswith("check 1"))
    assert check1.endswith(": ok")  # the same start weights: only the update shows the missing sync
