"""The supported vLLM minor is checked at engine start, with a message naming the supported range."""

import tomllib
from pathlib import Path

import pytest

from opsd.rollout.vllm_reload import SUPPORTED_VLLM, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu", "0.32.1rc1.dev5+g123"])
def test_the_supported_minor_passes(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.11.0", "0.31.9", "0.33.0", "1.0.0", "unknown"])
def test_other_versions_are_refused_naming_the_range(version):
    with pytest.raises(RuntimeError, match=r"supports vLLM >=0\.32,<0\.33"):
        check_vllm_version(version)


def test_gpu_extra_pins_the_supported_minor_and_torch_2_8():
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    major, minor = SUPPORTED_VLLM
    assert project["optional-dependencies"]["gpu"] == [f"vllm>={major}.{minor},<{major}.{minor + 1}"]
    assert "torch>=2.8" in project["dependencies"]


def test_the_installed_vllm_is_supported():
    pytest.importorskip("vllm")
    check_vllm_version()


def test_the_server_samples_with_the_requested_settings_only(tiny_vlm_dir):
    from opsd.config import load_config
    from opsd.rollout.serve import serve_command

    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_vlm_dir}", "rollout.engine=server"])
    argv, _ = serve_command(cfg, str(tiny_vlm_dir))
    assert argv[argv.index("--generation-config") + 1] == "vllm"
