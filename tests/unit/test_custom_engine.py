"""Engines named by import path in the config, and weight-sync hooks without vLLM."""

import json

import pytest
import torch
from safetensors.torch import load_file

from opsd.config import ConfigError
from opsd.rollout import make_engine
from opsd.rollout.receivers import INDEX_NAME, SafetensorsWriter
from opsd.rollout.weight_sync import push_weights
from tests.helpers.runs import demo_config

RECORDING_ENGINE = "tests.helpers.recording_engine:RecordingEngine"


def test_engine_import_path_is_checked_at_config_load(tmp_path, tiny_vlm_dir, grid_data_dir):
    for bad in ("vlm", "mypkg.engines", "mypkg.engines:", "my-pkg:Engine", ":Engine"):
        with pytest.raises(ConfigError, match="rollout.engine"):
            demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, f"rollout.engine={bad}")


@pytest.mark.parametrize("path, message", [
    ("no_such_pkg.engines:Engine", "cannot import module 'no_such_pkg.engines'"),
    ("tests.helpers.recording_engine:NoSuchEngine", "has no attribute 'NoSuchEngine'"),
    ("tests.helpers.recording_engine:json", "is not a class or function"),
    ("collections:OrderedDict", "OrderedDict has no generate, begin_weight_update"),
    ("tests.helpers.recording_engine:Undeclared", "without `capabilities`: declare its optional abilities"),
    ("tests.helpers.recording_engine:SleepsWithoutMethod",
     "SleepsWithoutMethod.capabilities declares release_memory but SleepsWithoutMethod has no such method"),
])
def test_bad_engine_import_path_fails_at_start_naming_the_key(tmp_path, tiny_vlm_dir, grid_data_dir, path, message):
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, f"rollout.engine={path}")
    with pytest.raises(ConfigError, match="rollout.engine") as info:
        make_engine(cfg, str(tiny_vlm_dir), processor=None)
    assert message in str(info.value) and path in str(info.value)


def test_safetensors_writer_receives_weights_without_an_engine(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    writer = SafetensorsWriter(tmp_path / "weights")
    for _ in range(2):  # a second update replaces the first
        with torch.no_grad():
            model[0].weight.add_(1.0)
        stats = push_weights(model, writer, bucket_mb=4 * 8 * 16 / 2**20)
    index = json.loads((tmp_path / "weights" / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert writer.updates == 2 and len(files) == stats.buckets >= 2
    assert sorted(p.name for p in (tmp_path / "weights").glob("*.safetensors")) == files
    loaded = {name: t for f in files for name, t in load_file(tmp_path / "weights" / f).items()}
    assert set(loaded) == set(index["weight_map"]) == {name for name, _ in model.named_parameters()}
    assert all(torch.equal(loaded[name], p) for name, p in model.named_parameters())
    assert index["metadata"]["total_size"] == stats.bytes
