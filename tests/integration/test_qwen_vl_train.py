"""Short runs of `opsd.train` on the tiny Qwen2.5-VL and Qwen3-VL (transformers rollouts) with the ThinkMorph schema."""

import json
import math

import pytest

from opsd.config import load_config
from opsd.train import train
from tests.helpers.datafiles import write_thinkmorph


@pytest.mark.slow
@pytest.mark.parametrize("build, fixture", [("tiny-qwen2.5-vl", "tiny_qwen_vl_dir"), ("tiny-qwen3-vl", "tiny_qwen3_vl_dir")])
def test_three_steps_on_thinkmorph_rows_with_the_hf_engine(tmp_path, request, build, fixture):
    model_dir = request.getfixturevalue(fixture)
    data = write_thinkmorph(tmp_path / "tm.parquet", n_good=8, defects=[])
    cfg = load_config("configs/smoke.yaml", [
        f"model.path={model_dir}", f"model.build={build}", "rollout.engine=hf",
        "data.path=null", f"data.datasets=[{{path: {data}, schema: thinkmorph}}]", "data.synthetic=null",
        f"logging.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "train.max_steps=3",
        "rollout.max_new_tokens=12", "train.grad_accum_steps=1", "eval.every=0", "checkpoint.save_every=0",
    ])
    out = train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["loss"]) and r["completion_tokens"] > 0
        assert r["logprob_mismatch_max"] < 1e-4  # the hf engine sampled with the scored weights, mrope included
    assert records[-1]["grad_norm"] > 0
