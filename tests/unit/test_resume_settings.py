"""A resume applies the settings it lists as changed: the optimizer's and the LR schedule's saved
state hold the checkpoint run's settings, which this run's replace (docs/checkpoints.md)."""

import shutil
import warnings

import pytest

from opsd.config import config_from_dict
from opsd.trainer.checkpoint_manager import CheckpointManager
from tests.helpers.parts import make_parts, take_steps

SAVED_AT = 3
BASE = {"optim": {"lr": 1e-2, "min_lr": 1e-4, "warmup_steps": 2, "schedule": "cosine"}, "train": {"max_steps": 6}}


def config(output_dir, changed=None, **checkpoint):
    tree = {"model": {"path": "m"}, "data": {"path": "d"}, "logging": {"output_dir": str(output_dir)},
            "checkpoint": checkpoint, "optim": dict(BASE["optim"]), "train": dict(BASE["train"])}
    for key, value in (changed or {}).items():
        section, name = key.split(".")
        tree[section][name] = value
    return config_from_dict(tree)


def parts_for(cfg, model_dir):
    return make_parts(model_dir, optim_cfg=cfg.optim, max_steps=cfg.train.max_steps)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_text_dir):
    """A run of the BASE settings with its checkpoint after step 3."""
    run = tmp_path_factory.mktemp("resume-settings") / "run"
    cfg = config(run)
    parts = parts_for(cfg, tiny_text_dir)
    manager = CheckpointManager(cfg, run)
    manager.start(parts)
    take_steps(parts, SAVED_AT)
    manager.save(SAVED_AT, {})
    return run


def schedule_steps(parts, n):
    with warnings.catch_warnings():  # no optimizer step in between: only the schedule is compared
        warnings.simplefilter("ignore")
        for _ in range(n):
            parts.scheduler.step()


@pytest.mark.parametrize("key, value", [
    ("optim.lr", 5e-3), ("optim.min_lr", 1e-3), ("optim.warmup_steps", 5), ("optim.schedule", "constant"),
    ("optim.betas", (0.5, 0.6)), ("optim.eps", 1e-6), ("optim.weight_decay", 0.1), ("train.max_steps", 12),
])
def test_a_resume_applies_each_changed_setting_of_the_optimizer_and_schedule(saved_run, tmp_path, tiny_text_dir, key, value):
    """Resumed at step 3 with one setting changed, the optimizer and the schedule are those of a fresh
    run of the new settings at step 3 (the moments aside), and stay so for the steps after."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    cfg = config(run, {key: value}, resume_from="auto")
    resumed, fresh = parts_for(cfg, tiny_text_dir), parts_for(cfg, tiny_text_dir)
    assert CheckpointManager(cfg, run).start(resumed) == SAVED_AT
    schedule_steps(fresh, SAVED_AT)
    for _ in range(4):
        got, want = resumed.optimizer.param_groups[0], fresh.optimizer.param_groups[0]
        for name in ("lr", "initial_lr", "betas", "eps", "weight_decay"):
            assert got[name] == pytest.approx(want[name], rel=1e-12), (key, name)
        schedule_steps(resumed, 1)
        schedule_steps(fresh, 1)
