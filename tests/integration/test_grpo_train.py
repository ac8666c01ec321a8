"""GRPO end to end: `loss.kind: grpo` trains the tiny vision-language model with the vLLM engine on
rewards from a function given by import path (no teacher forward), a reward per completion, the
advantages per prompt group, the reward metrics in every step."""

import math

import pytest

from opsd.train import train
from tests.helpers.runs import demo_config, read_metrics


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_trains_with_vllm_on_rewards_by_import_path(tmp_path, tiny_vlm_dir, grid_data_dir):
    cfg = demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, "train.max_steps=2", "eval.every=0", "checkpoint.save_every=0",
                      "loss={kind: grpo, clip_eps: 0.2}",
                      "reward={functions: [{name: 'tests.helpers.rewards:even_tokens'}, {name: answer_format, weight: 0.5}]}")
    records = read_metrics(train(cfg))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"grpo_loss", "reward/mean", "reward/tests.helpers.rewards:even_tokens", "reward/answer_format",
                "reward/within_prompt_std", "reward/all_alike_fraction"} <= r.keys()
        assert "jsd" not in r and "teacher_topk_mass" not in r and "time_train/teacher_forward_s" not in r
        assert 0 <= r["reward/mean"] <= 1.5 and r["reward/within_prompt_std"] > 0 and r["reward/all_alike_fraction"] < 1
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["logprob_mismatch_max"] < 1e-3  # ratio 1: the engine sampled with the trainer's weights
