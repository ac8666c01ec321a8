"""Checkpoint format without a rollout engine: round trip, crash safety, rotation, corrupt or
mismatched checkpoints, RNG states, metrics.jsonl continuation and the resume rules."""

import json
import random
import sys
import types

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from opsd.config import ConfigError, LoggingConfig, OptimConfig, TeacherConfig, config_from_dict, load_config
from opsd.teacher import make_teacher
from opsd.trainer import checkpoint as ckpt
from opsd.trainer.checkpoint import (
    CheckpointError,
    TrainingParts,
    list_checkpoints,
    load_checkpoint,
    load_rng_state,
    remove_leftovers,
    resolve_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from opsd.trainer.checkpoint_manager import CheckpointManager, changed_settings
from opsd.trainer.metrics import MetricsLogger, drop_records_after
from opsd.trainer.optim import build_optimizer
from opsd.trainer.rng import rng_state, set_rng_state
from tests.helpers.parts import assert_same_tensors, make_parts, run_config, take_steps


@pytest.fixture
def saved(tmp_path, tiny_text_dir):
    """A checkpoint of the tiny text model after 3 steps, and the parts that wrote it."""
    parts = make_parts(tiny_text_dir)
    take_steps(parts, 3)
    path = save_checkpoint(tmp_path / "run", 3, parts, {"step": 3, "note": "unit"})
    return path, parts


def test_round_trip_restores_weights_optimizer_schedule_and_teacher(saved, tiny_text_dir):
    path, parts = saved
    assert [c.step for c in list_checkpoints(path.parent)] == [3]
    assert (path / "model" / "model.safetensors").is_file() and (path / "teacher" / "config.json").is_file()

    fresh = make_parts(tiny_text_dir)
    take_steps(fresh, 1)  # different state everywhere, to be overwritten
    manifest = load_checkpoint(path, fresh)
    assert manifest["step"] == 3 and manifest["teacher_mode"] == "ema"
    assert_same_tensors(fresh.student.state_dict(), parts.student.state_dict())
    assert_same_tensors(fresh.teacher.module.state_dict(), parts.teacher.module.state_dict())
    assert not torch.equal(fresh.teacher.module.lm_head.weight, fresh.student.lm_head.weight)
    assert fresh.scheduler.state_dict() == parts.scheduler.state_dict()
    saved_optim, loaded_optim = parts.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert saved_optim["param_groups"] == loaded_optim["param_groups"]
    for index, state in saved_optim["state"].items():
        assert_same_tensors(state, loaded_optim["state"][index])

    # One more step from both gives the same weights: nothing that matters was left out.
    torch.manual_seed(11)
    take_steps(parts, 1)
    torch.manual_seed(11)
    take_steps(fresh, 1)
    assert_same_tensors(fresh.student.state_dict(), parts.student.state_dict())


def test_weights_only_load_takes_student_or_ema_weights(saved, tiny_text_dir):
    path, parts = saved
    fresh = make_parts(tiny_text_dir)
    load_checkpoint(path, fresh, weights_only=True)
    assert_same_tensors(fresh.student.state_dict(), parts.student.state_dict())
    assert not fresh.optimizer.state  # the optimizer stays fresh
    load_checkpoint(path, fresh, weights_only=True, from_ema=True)
    assert_same_tensors(fresh.student.state_dict(), parts.teacher.module.state_dict())


def test_rng_states_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = rng_state()
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)
    set_rng_state(state)
    assert (random.random(), np.random.rand(), np.random.randn()) == expected[:3]
    assert torch.equal(torch.rand(3), expected[3])


def test_saved_rng_state_loads_without_pickled_code(saved):
    path, _ = saved
    state = load_rng_state(path)  # torch.load(weights_only=True) inside
    assert state["python"]["version"] == 3 and state["torch"].dtype == torch.uint8


@pytest.mark.parametrize("stage", ["model", "train_state", "commit"])
def test_interrupted_save_is_ignored_then_cleaned(stage, tmp_path, tiny_text_dir, monkeypatch):
    parts = make_parts(tiny_text_dir)
    take_steps(parts, 1)
    run = tmp_path / "run"
    save_checkpoint(run, 1, parts, {"step": 1})

    def crash(at, step):
        if at == stage:
            raise KeyboardInterrupt(f"killed at {stage}")

    monkeypatch.setattr(ckpt, "_fault_point", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run, 2, parts, {"step": 2})
    assert (run / "checkpoint-2.tmp").is_dir() and not (run / "checkpoint-2").exists()
    assert [c.step for c in list_checkpoints(run)] == [1]
    assert resolve_checkpoint(run).name == "checkpoint-1"
    assert remove_leftovers(run) == [run / "checkpoint-2.tmp"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1"]


def fake_checkpoints(run, steps):
    """Complete-looking checkpoint directories (manifest and trainer state only)."""
    for step in steps:
        path = run / f"checkpoint-{step}"
        path.mkdir(parents=True)
        (path / ckpt.MANIFEST).write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, "files": {}}))
        (path / ckpt.TRAINER_STATE).write_text(json.dumps({"step": step, "counters": {}, "config": {}}))


@pytest.mark.parametrize(
    "limit, keep, remaining",
    [
        (2, set(), [4, 5]),
        (1, {2}, [2, 5]),  # the best survives, and so does the newest
        (3, {1}, [1, 4, 5]),
        (1, {5}, [5]),
        (9, set(), [1, 2, 3, 4, 5]),
    ],
)
def test_rotation_keeps_newest_and_best(tmp_path, limit, keep, remaining):
    fake_checkpoints(tmp_path, [1, 2, 3, 4, 5])
    (tmp_path / "checkpoint-6.tmp").mkdir()  # half-written: neither counted nor touched
    rotate_checkpoints(tmp_path, limit, keep)
    assert [c.step for c in list_checkpoints(tmp_path)] == remaining
    assert (tmp_path / "checkpoint-6.tmp").is_dir()


def test_missing_file_is_named(saved, tiny_text_dir):
    path, _ = saved
    (path / "model" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"corrupt: model/config\.json is missing"):
        load_checkpoint(path, make_parts(tiny_text_dir))


def test_replaced_config_is_named(saved, tiny_text_dir, tiny_vlm_dir):
    path, _ = saved
    (path / "model" / "config.json").write_text((tiny_vlm_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model/config\.json (has \d+ bytes|differs)"):
        load_checkpoint(path, make_parts(tiny_text_dir))


def test_truncated_training_state_is_named(saved, tiny_text_dir):
    path, _ = saved
    shard = next((path / "train_state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"train_state/{shard.name} has 100 bytes"):
        load_checkpoint(path, make_parts(tiny_text_dir))


def test_missing_manifest_means_incomplete(saved, tiny_text_dir):
    path, _ = saved
    (path / ckpt.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="incomplete: opsd_checkpoint.json is missing"):
        resolve_checkpoint(path)
    with pytest.raises(CheckpointError, match="not a complete opsd checkpoint"):
        load_checkpoint(path, make_parts(tiny_text_dir))


def test_checkpoint_of_another_model_is_refused(saved, tiny_vlm_dir):
    path, _ = saved
    with pytest.raises(CheckpointError, match=r"holds a qwen2 model .*model.path is idefics3"):
        load_checkpoint(path, make_parts(tiny_vlm_dir))


def test_checkpoint_with_other_shapes_is_refused(saved, tiny_text_dir):
    path, parts = saved
    config = AutoConfig.from_pretrained(tiny_text_dir)
    config.intermediate_size *= 2
    wider = AutoModelForCausalLM.from_config(config)
    other = TrainingParts(wider, make_teacher(TeacherConfig(mode="self"), wider), build_optimizer(OptimConfig(), wider),
                          parts.scheduler, parts.processor)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape \[\d+, \d+\] in the checkpoint, \[\d+, \d+\] in the model"):
        load_checkpoint(path, other)


def test_teacher_mode_change_is_refused(saved, tiny_text_dir):
    path, _ = saved
    with pytest.raises(CheckpointError, match="teacher.mode=ema, this run has teacher.mode=self"):
        load_checkpoint(path, make_parts(tiny_text_dir, teacher_mode="self"))


def test_ema_weights_need_an_ema_checkpoint(tmp_path, tiny_text_dir):
    parts = make_parts(tiny_text_dir, teacher_mode="self")
    path = save_checkpoint(tmp_path, 1, parts, {"step": 1})
    assert not (path / "teacher").exists()
    with pytest.raises(CheckpointError, match="no EMA weights"):
        load_checkpoint(path, make_parts(tiny_text_dir, teacher_mode="self"), weights_only=True, from_ema=True)


def test_fresh_start_refuses_a_directory_with_checkpoints(tmp_path):
    fake_checkpoints(tmp_path, [2, 4])
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(checkpoint-2, checkpoint-4\): set checkpoint.resume_from=auto"):
        CheckpointManager(run_config(tmp_path), tmp_path)
    with pytest.raises(CheckpointError, match="resume_model_only starts a new run"):
        CheckpointManager(run_config(tmp_path, resume_from="auto", resume_model_only=True), tmp_path)


def test_resume_refuses_later_checkpoints_and_picks_the_newest(tmp_path):
    fake_checkpoints(tmp_path, [2, 4])
    (tmp_path / "checkpoint-6.tmp").mkdir()
    manager = CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path)
    assert manager.source.name == "checkpoint-4" and manager.resume_step == 4
    assert not (tmp_path / "checkpoint-6.tmp").exists()  # cleaned at start
    with pytest.raises(CheckpointError, match=r"later checkpoints \(checkpoint-4\)"):
        CheckpointManager(run_config(tmp_path, resume_from=str(tmp_path / "checkpoint-2")), tmp_path)


def test_resume_from_nothing(tmp_path):
    assert CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path).source is None
    with pytest.raises(CheckpointError, match="no opsd checkpoint at"):
        CheckpointManager(run_config(tmp_path / "new", resume_from=str(tmp_path / "missing")), tmp_path / "new")


@pytest.mark.parametrize(
    "checkpoint, message",
    [
        ({"resume_model_only": True}, "resume_model_only needs checkpoint.resume_from"),
        ({"resume_from": "auto", "resume_from_ema": True}, "resume_from_ema needs checkpoint.resume_model_only"),
        ({"save_every": -1}, "checkpoint.save_every"),
        ({"save_total_limit": 0}, "checkpoint.save_total_limit"),
    ],
)
def test_checkpoint_config_errors_name_the_key(checkpoint, message):
    with pytest.raises(ConfigError, match=message):
        run_config("out", **checkpoint)


def test_changed_settings_lists_what_differs():
    saved = {"train": {"max_steps": 4, "seed": 0}, "checkpoint": {"save_every": 2}, "logging": {"progress_bar": True}}
    now = {"train": {"max_steps": 6, "seed": 0}, "checkpoint": {"save_every": 3}, "logging": {"progress_bar": False}}
    assert changed_settings(saved, now) == ["train.max_steps: 4 -> 6"]


def test_metrics_continue_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    logger = MetricsLogger(LoggingConfig(), tmp_path, {}, resume_step=3)
    logger.log(4, {"loss": 9.0})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["loss"] == 9.0


def test_lines_that_are_not_records_and_later_steps_are_dropped_once_and_named(tmp_path):
    """What two runs writing one file (before the output-directory lock) or a killed one left."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n{"step": 3}\n')
    assert drop_records_after(path, 2) == (f"metrics: dropped 1 record(s) of steps 3-3, logged after checkpoint-2 and "
                                            f"1 line(s) that are not JSON records (a write cut short) from {path}; "
                                            "this run continues after step 2")
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    before = path.stat().st_ino
    assert drop_records_after(path, 2) is None and path.stat().st_ino == before  # nothing to drop: not rewritten


def test_wandb_run_is_continued(tmp_path, monkeypatch, capsys):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(id=kw["id"] or "new1", finish=lambda: None),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(wandb={"mode": "offline"})
    assert MetricsLogger(cfg, tmp_path, {}).wandb_run_id == "new1"
    assert calls[-1]["id"] is None and calls[-1]["resume"] is None
    # wandb's banners stay off the console (unless logging.verbose); one line of opsd's says where the run goes
    assert calls[-1]["settings"] == {"silent": True}
    assert capsys.readouterr().out == f"wandb: run new1, offline under {tmp_path}/wandb (upload later: wandb sync {tmp_path}/wandb/offline-run-*)\n"
    assert MetricsLogger(cfg, tmp_path, {}, resume_step=0, wandb_run_id="abc").wandb_run_id == "abc"
    assert calls[-1]["id"] == "abc" and calls[-1]["resume"] == "allow"


def test_weights_only_resume_starts_a_new_run_from_the_ema_weights(saved, tmp_path, tiny_text_dir):
    path, trained = saved
    cfg = run_config(tmp_path / "new", resume_from=str(path.parent), resume_model_only=True, resume_from_ema=True)
    manager = CheckpointManager(cfg, tmp_path / "new")
    assert manager.resume_step is None and manager.saved_wandb_run_id is None  # fresh metrics and wandb run
    parts = make_parts(tiny_text_dir)
    assert manager.start(parts) == 0 and manager.source is not None
    assert_same_tensors(parts.student.state_dict(), trained.teacher.module.state_dict())
    assert_same_tensors(parts.teacher.module.state_dict(), trained.teacher.module.state_dict())  # the teacher starts there too
    assert not parts.optimizer.state and parts.stream.state_dict()["positions"] == [0]


def test_continued_run_restores_data_position_counters_and_rng(tmp_path, tiny_text_dir):
    parts = make_parts(tiny_text_dir)
    manager = CheckpointManager(run_config(tmp_path, save_every=2), tmp_path)
    manager.start(parts)
    take_steps(parts, 2)
    parts.stream.take(3)
    manager.step_end(1, {"completion_tokens": 5, "loss": 1.0})
    manager.step_end(2, {"completion_tokens": 7, "loss": 0.5})  # saves checkpoint-2
    expected = (random.random(), np.random.rand(), torch.rand(3))  # what the run would draw next

    resumed = CheckpointManager(run_config(tmp_path, save_every=2, resume_from="auto"), tmp_path)
    fresh = make_parts(tiny_text_dir)
    assert resumed.start(fresh) == 2 and resumed.resume_step == 2
    resumed.restore_rng()
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])
    assert fresh.stream.state_dict() == parts.stream.state_dict()
    assert resumed.counters == {"completion_tokens": 12, "skipped_steps": 0}


@pytest.mark.parametrize("save_every, save_final, saved_steps", [
    (0, True, [4]),  # only at the end
    (2, True, [2, 4]),
    (0, False, []),  # a sweep keeping only its metrics
    (3, False, [3]),  # the periodic saves stay
])
def test_saves_every_n_steps_and_at_the_end_unless_save_final_is_off(tmp_path, save_every, save_final, saved_steps):
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "train": {"max_steps": 4},
                            "logging": {"output_dir": str(tmp_path)},
                            "checkpoint": {"save_every": save_every, "save_final": save_final}})
    manager = CheckpointManager(cfg, tmp_path)
    saves = []
    manager.save = lambda step, record: saves.append(step)
    for step in range(1, 5):
        manager.step_end(step, {"completion_tokens": 1})
    assert saves == saved_steps and manager.counters["completion_tokens"] == 4


@pytest.mark.parametrize("overrides, line", [
    (["checkpoint.save_every=10"], "checkpoints every 10 steps"),
    (["checkpoint.save_every=0"], "checkpoints every 20 steps"),  # the end: train.max_steps
    (["checkpoint.save_every=10", "checkpoint.save_final=false"],
     "checkpoints every 10 steps, none at the end (checkpoint.save_final: false; a stop signal saves)"),
    (["checkpoint.save_every=0", "checkpoint.save_final=false", "checkpoint.save_on_signal=false"],
     "no checkpoints (checkpoint.save_final: false)"),
    (["checkpoint.save_every=10", "checkpoint.save_total_limit=2", "checkpoint.resume_from=auto"],
     "checkpoints every 10 steps, keep 2, resume from auto"),
    (["checkpoint.save_final=false", "checkpoint.save_total_limit=2", "checkpoint.resume_from=auto"],
     "no checkpoints (checkpoint.save_final: false; a stop signal saves), resume from auto"),  # nothing to keep
])
def test_the_plan_says_when_checkpoints_are_written(overrides, line):
    from opsd.train import describe_plan

    cfg = load_config("configs/smoke.yaml", ["train.max_steps=20", "checkpoint.save_every=0", "checkpoint.save_total_limit=null",
                                             "checkpoint.resume_from=null", *overrides])
    assert f"  {line}" in describe_plan(cfg).splitlines()
