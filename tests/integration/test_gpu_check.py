"""scripts/gpu_check.py: the CUDA checks (tests marked `gpu`, skipped without CUDA), and its report on any machine."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_says_what_ran_and_what_was_skipped(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--only", "environment", "fsdp_nccl_ema_sync"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads(out.read_text())["checks"]
    assert checks["environment"]["status"] == "ran" and checks["environment"]["torch"] == torch.__version__
    fsdp = checks["fsdp_nccl_ema_sync"]
    if torch.cuda.is_available():
        assert fsdp["status"] == "ran", fsdp
    else:
        assert fsdp == {"status": "skipped", "reason": "no CUDA device", "seconds": fsdp["seconds"]}
        assert "fsdp_nccl_ema_sync: skipped (no CUDA device)" in proc.stdout


def test_the_fsdp_check_trains_an_ema_teacher_on_gloo_with_device_cpu(tmp_path):
    """The FSDP2 check's own logic on the CPU (gloo for nccl): its EMA teacher moves by exactly the
    update's formula. Its first GPU run reported an unmoved teacher: it looked at the vision tower's
    first weight, which the text-only examples never train."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--only", "fsdp_nccl_ema_sync", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fsdp = json.loads(out.read_text())["checks"]["fsdp_nccl_ema_sync"]
    assert fsdp["status"] == "ran" and fsdp["ok"] and fsdp["backend"] == "gloo", fsdp
    assert fsdp["ema_teacher_moved"] > 1e-4 and fsdp["ema_update_error"] < 1e-6, fsdp


@pytest.mark.parametrize("fixture", ["tiny_qwen_vl_dir", "tiny_qwen3_vl_dir"])
def test_the_shaped_checks_inputs_and_scoring_run_on_the_tiny_qwen_vl_models(request, fixture):
    """What `qwen25vl_7b_shaped` / `qwen3vl_8b_shaped` run on a GPU, on the tiny models of the same
    families on CPU: the inputs they lay out are ones the model accepts, and every parameter
    (the vision tower and, for Qwen3-VL, its DeepStack mergers) gets a gradient."""
    from transformers import AutoModelForImageTextToText

    check = gpu_check()
    model = AutoModelForImageTextToText.from_pretrained(request.getfixturevalue(fixture), dtype=torch.float32)
    inputs = check.qwen_vl_inputs(model.config, tokens=300, images=2, device="cpu", side_pixels=128)
    grid = inputs["image_grid_thw"]
    assert (inputs["mm_token_type_ids"] == 1).sum() == grid.prod(-1).sum() // 4  # 2x2 merge
    result = check.forward_backward(model, inputs, completion=16)
    assert result["ok"] and result["all_parameters_have_grads"] and result["tokens"] == 300, result


def test_the_recipe_runs_are_configs_the_recipe_accepts(tmp_path):
    """`recipe_runs` trains on a GPU only; here each run's overrides load (a renamed key fails here first)."""
    from opsd.config import load_config

    check = gpu_check()
    for run in check.RECIPE_RUNS:
        cfg = load_config("configs/smoke.yaml", check._recipe_overrides(run, tmp_path, "cuda"))
        assert cfg.rollout.engine == "hf" and cfg.train.device == "cuda", run["name"]
        assert cfg.logging.output_dir == str(tmp_path / run["name"]), run["name"]


class Args:
    tokens = 9216
    images = 4
    device = "cuda"


@pytest.mark.gpu
@needs_cuda
def test_fsdp_on_nccl_trains_with_an_ema_teacher_and_syncs_in_bfloat16():
    result = gpu_check().check_fsdp_nccl_ema_sync(Args())
    assert result["ok"], result


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("check, parameters, deepstack", [
    ("check_qwen25vl_7b_shaped", 8_292_166_656, 0),  # Qwen2.5-VL-7B with its vision tower
    ("check_qwen3vl_8b_shaped", 8_767_123_696, 3),  # Qwen3-VL-8B, DeepStack from 3 vision blocks
])
def test_a_7b_or_8b_shaped_qwen_vl_scores_9k_tokens_with_images(check, parameters, deepstack):
    if torch.cuda.get_device_properties(0).total_memory < 60e9:
        pytest.skip("needs a GPU with 60 GB or more")
    result = getattr(gpu_check(), check)(Args())
    assert result["ok"], result
    assert result["parameters"] == parameters and result["tokens"] == 9216 and result["deepstack_layers"] == deepstack


@pytest.mark.gpu
@needs_cuda
def test_vllm_sleeps_takes_the_weights_and_matches_the_trainer():
    pytest.importorskip("vllm")
    result = gpu_check().check_vllm_sleep_sync_parity(Args())
    assert result["ok"], result

