"""Rewards: the built-ins, functions by import path, their weighted sum, group advantages and the
one-line errors of a function that fails."""

import math

import pytest
import torch

import opsd.train
from opsd.config import ConfigError, RewardConfig, RewardFunctionConfig, REWARD_BUILTINS, load_config
from opsd.data.sample import Sample
from opsd.loss import group_advantages
from opsd.rewards import BUILTINS, RewardError, Rewards, reward_metrics
from opsd.rollout import Completion

PATTERN = r"<answer>(.*?)</answer>"


def sample(i=0, answer="7"):
    return Sample(id=f"s{i}", question="?", images=[], privileged_images=[], answer=answer)


def rewards(*functions, scale_by_std=True):
    cfg = RewardConfig(functions=[RewardFunctionConfig(name, weight) for name, weight in functions], scale_by_std=scale_by_std)
    return Rewards.from_config(cfg, PATTERN)


def completion(prompt_index, text, ids=(1, 2)):
    return Completion(prompt_index, list(ids), [0.0] * len(ids), text=text)


def test_the_builtins_are_the_configs_names():
    assert tuple(BUILTINS) == REWARD_BUILTINS


def test_builtins_check_the_answer_as_evaluation_does():
    r = rewards(("answer_match", 1.0), ("answer_format", 0.5), ("answer_contains", 0.25))
    texts = ["<answer> 7. </answer>", "<answer>8</answer>", "it is 7", "nothing"]
    scored = r.score([sample()], [completion(0, t) for t in texts])
    assert scored.by_function == {"answer_match": [1, 0, 0, 0], "answer_format": [1, 1, 0, 0],
                                  "answer_contains": [1, 0, 1, 0]}
    assert scored.rewards == [1.75, 0.5, 0.25, 0.0]


def test_a_function_by_import_path_gets_the_sample_the_text_and_the_ids():
    r = rewards(("tests.helpers.rewards:short", 2.0))
    scored = r.score([sample()], [completion(0, "a", [5]), completion(0, "b", [5, 6, 7])])
    assert scored.rewards == [1.0, 0.5]


def test_advantages_of_hand_made_groups():
    groups = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    std = group_advantages(groups)
    a = 0.5 / math.sqrt(1 / 3)  # centred 0.5, unbiased std sqrt(1/3)
    assert std[0].tolist() == pytest.approx([a, -a, -a, a], abs=1e-5)
    assert std[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # all alike: exactly zero, no signal
    assert std[2].tolist() == pytest.approx([-0.5, 1.5, -0.5, -0.5], abs=1e-5)  # centred / std 1.5
    centred = group_advantages(groups, scale_by_std=False)
    assert centred.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, 2.25, -0.75, -0.75]]
    with pytest.raises(ValueError, match="samples >= 2"):
        group_advantages(torch.ones(3, 1))


def test_advantages_are_per_prompt_and_the_metrics_count_the_flat_groups():
    r = rewards(("answer_match", 1.0))
    samples = [sample(0, "7"), sample(1, "9")]
    texts = ["<answer>7</answer>", "<answer>1</answer>", "<answer>1</answer>", "<answer>2</answer>"]
    scored = r.score(samples, [completion(i // 2, t) for i, t in enumerate(texts)])
    assert scored.advantages[2:] == [0.0, 0.0] and scored.advantages[0] > 0 > scored.advantages[1]
    metrics = reward_metrics(r.names, scored.sums())
    assert metrics == pytest.approx({"reward/mean": 0.25, "reward/answer_match": 0.25,
                                     "reward/within_prompt_std": math.sqrt(0.5) / 2, "reward/all_alike_fraction": 0.5})


@pytest.mark.parametrize(("name", "message"), [
    ("raises", "reward function tests.helpers.rewards:raises raised on sample s3: KeyError: 'no such field\\nsecond line'"),
    ("not_finite", "reward function tests.helpers.rewards:not_finite returned nan on sample s3: rewards must be finite"),
    ("not_a_number", "reward function tests.helpers.rewards:not_a_number returned str on sample s3: it must return a float"),
])
def test_a_function_that_fails_is_named_with_the_sample_in_one_line(name, message):
    r = rewards((f"tests.helpers.rewards:{name}", 1.0))
    with pytest.raises(RewardError) as err:
        r.score([sample(3)], [completion(0, "x")])
    assert str(err.value) == message and "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "message"), [
    ("tests.helpers.rewards:nope", "reward function tests.helpers.rewards:nope: cannot import it (AttributeError: "),
    ("tests.helpers.no_module:f", "reward function tests.helpers.no_module:f: cannot import it (ModuleNotFoundError: "),
    ("tests.helpers.rewards:NOT_CALLABLE", "reward function tests.helpers.rewards:NOT_CALLABLE: int is not callable"),
])
def test_a_function_that_does_not_load_is_named(name, message):
    with pytest.raises(RewardError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        rewards((name, 1.0))


def test_a_reward_function_that_does_not_load_stops_the_run_with_status_2(tmp_path, tiny_vlm_dir, grid_data_dir, capfd):
    """Before any weights are loaded or an engine started: one `error:` line, status 2."""
    status = opsd.train.main(["--config", "configs/smoke.yaml", f"model.path={tiny_vlm_dir}",
                              f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
                              "reward={functions: [{name: 'tests.helpers.rewards:nope'}]}"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: reward function tests.helpers.rewards:nope"), err


@pytest.mark.parametrize(("overrides", "message"), [
    (["loss={kind: grpo}"], "loss.kind=grpo trains on rewards: add a reward section"),
    (["loss={kind: grpo}", "reward={}", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt must be >= 2 (got 1)"),
    (["loss.reward_weight=0.5", "rollout.samples_per_prompt=1", "reward={}"], "rollout.samples_per_prompt must be >= 2"),
    (["loss={kind: grpo, kl_weight: 0.1}", "reward={}"], "loss.kl_weight > 0 is a KL to the initial weights: set teacher.mode=fixed"),
    (["reward={functions: [{name: answer_matc}]}"], "must be one of answer_match, answer_format, answer_contains or an import path"),
    (["reward={functions: []}"], "reward.functions"),
])
def test_reward_settings_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("configs/smoke.yaml", overrides)


def test_grpo_and_the_mixed_term_load():
    cfg = load_config("configs/smoke.yaml", ["loss={kind: grpo}", "reward={}", "teacher.mode=fixed"])
    assert cfg.loss.kind == "grpo" and cfg.reward.functions[0].name == "answer_match"
    cfg = load_config("configs/smoke.yaml", ["loss.reward_weight=0.5", "reward={}"])
    assert cfg.loss.reward_weight == 0.5 and cfg.loss.clip_eps == 0.2
