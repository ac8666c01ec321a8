"""The seeing SmolLM2 (opsd.smollm2_vlm) on a reduced setting: a few alignment steps build a model
directory that loads, is cached, and is the same for the same seed; the image token moves towards
the word its picture shows."""

import json

import pytest
from safetensors.torch import load_file

from opsd.smollm2_vlm import IMAGE_SEQ_LEN, BuildSettings, build


@pytest.mark.slow
def test_build_is_timed_cached_and_deterministic(tmp_path, smollm2_dir):
    settings = BuildSettings(align_steps=4, align_batch=8, eval_items=16)
    first = build(tmp_path / "a", settings=settings, text_dir=smollm2_dir, log=lambda _: None)
    record = json.loads((first / "build.json").read_text())
    assert record["settings"]["align_steps"] == 4 and record["wall_s"] > 0 and record["cpu_s"] > 0
    assert 0.0 <= record["accuracy_before"] <= 1.0 and 0.0 <= record["accuracy"] <= 1.0
    assert record["mse"] < 0.8 * record["mse_before"]  # four steps already move the image token towards its word
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"] and IMAGE_SEQ_LEN == 1
    assert not (tmp_path / "a.partial").exists()
    # A finished build is reused, not redone.
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build(tmp_path / "a", settings=settings, text_dir=smollm2_dir, log=lambda _: None) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # The same seed and settings: the same weights.
    second = build(tmp_path / "b", settings=settings, text_dir=smollm2_dir, log=lambda _: None)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
