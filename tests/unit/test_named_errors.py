"""A new user's mistakes end in one `error:` line naming the path, module or class, with status 2
and no traceback (`python -m opsd.train`, the `--check` self-test and the dumps CLI alike)."""

import pytest

import opsd.train
from opsd.rollouts import main as dumps_main


def args(tmp_path, model_dir, data_dir, *overrides):
    return ["--config", "configs/smoke.yaml", f"model.path={model_dir}", f"data.path={data_dir}",
            f"logging.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", *overrides]


def one_error_line(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("model_path", ["{tmp}/models/nope", "tests/no-such-model"])  # tests/ is here: local
def test_a_missing_model_path_is_named(model_path, tmp_path, grid_data_dir, capfd):
    model_path = model_path.format(tmp=tmp_path)
    (tmp_path / "models").mkdir()
    assert opsd.train.main(args(tmp_path, model_path, grid_data_dir, "model.build=null")) == 2
    line = one_error_line(capfd)
    assert line.startswith("error: model.path: no Hugging Face model directory at ") and model_path in line
    assert "(no such directory); set model.path to a model directory, or model.build to build one there" in line


@pytest.mark.parametrize("command", ["train", "check", "dump"])
def test_an_engine_module_that_does_not_import_is_named(command, tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    engine = "rollout.engine=tests.helpers.broken_engine:Engine"
    if command == "dump":
        status = dumps_main(["dump", *args(tmp_path, tiny_vlm_dir, grid_data_dir, engine)[:4], "--out", str(tmp_path / "d"),
                             "--num-samples", "1", engine])
    else:
        status = opsd.train.main(args(tmp_path, tiny_vlm_dir, grid_data_dir, engine) + (["--check"] if command == "check" else []))
    assert status == 2
    line = one_error_line(capfd)
    assert line.startswith("error: rollout.engine: module 'tests.helpers.broken_engine' of "
                           "'tests.helpers.broken_engine:Engine' does not import: ModuleNotFoundError: "
                           "No module named 'opsd_no_such_dependency' (")
    assert "broken_engine.py, line 3)" in line


def test_a_missing_engine_module_is_named(tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    assert opsd.train.main(args(tmp_path, tiny_vlm_dir, grid_data_dir, "rollout.engine=mypkg.engines:Engine")) == 2
    assert one_error_line(capfd) == ("error: rollout.engine: cannot import module 'mypkg.engines' of 'mypkg.engines:Engine': "
                                     "no module named 'mypkg' (is it installed, or on PYTHONPATH?)")


def test_an_engine_class_without_close_is_named_before_it_is_built(tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    engine = "tests.helpers.odd_engines:EngineWithoutClose"
    assert opsd.train.main(args(tmp_path, tiny_vlm_dir, grid_data_dir, f"rollout.engine={engine}")) == 2
    assert one_error_line(capfd) == (
        f"error: rollout.engine: '{engine}': EngineWithoutClose has no close method; an engine needs generate, "
        "begin_weight_update, receive_weights, end_weight_update, close (opsd/rollout/engine.py)"
    )


@pytest.mark.parametrize("gpus, local_ranks, expected", [
    (0, "1", "error: train.device is 'cuda' but no CUDA device is available: set train.device=auto or cpu"),
    (1, "2", "error: train.device is 'cuda' and torchrun started 2 ranks on this machine, which has 1 CUDA device(s) visible: "
             "one rank per GPU (--nproc-per-node 1), or train.device=cpu"),
])
@pytest.mark.parametrize("command", ["train", "check"])
def test_a_cuda_device_that_is_not_there_is_named(gpus, local_ranks, expected, command, tmp_path, tiny_vlm_dir, grid_data_dir,
                                                   capfd, monkeypatch):
    """What a GPU machine with fewer GPUs than ranks (the lent one ran two ranks on one H200), or a
    machine with none, says: one line, before any rank asks for a device that does not exist."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    check = ["--check"] if command == "check" else []
    assert opsd.train.main(args(tmp_path, tiny_vlm_dir, grid_data_dir, "train.device=cuda") + check) == 2
    assert one_error_line(capfd) == expected


def test_a_config_mistake_is_named_before_torch_is_imported():
    """`python -m opsd.train` checks the command line first: no torch, transformers or vLLM import
    stands between a typo and its error line."""
    import os
    import subprocess
    import sys

    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))  # carried wheels live there
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "opsd.train", "--config", "configs/smoke.yaml",
                           "train.max_stpes=3"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2 and "error: invalid config:\n  train.max_stpes: Unexpected keyword argument" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "opsd" in imported and not imported & {"torch", "transformers", "vllm"}
