"""What a run's checkpoints do when things go wrong: a save onto a full disk, a save that did not
finish, a corrupt newest checkpoint, more than one rank talking."""

import re
import shutil
import uuid

import pytest
import torch

from opsd.trainer import checkpoint as ckpt
from opsd.trainer.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from opsd.trainer.checkpoint_manager import CheckpointManager
from tests.helpers.disk import fill, small_file_system
from tests.helpers.parts import assert_same_tensors, make_parts, run_config, take_steps


def saved_parts(tiny_text_dir, steps=1):
    parts = make_parts(tiny_text_dir)
    take_steps(parts, steps)
    return parts


def test_a_save_onto_a_full_disk_names_the_cause_and_keeps_the_previous_checkpoint(small_disk, tiny_text_dir, monkeypatch):
    run, mounted = small_disk
    parts = saved_parts(tiny_text_dir)
    save_checkpoint(run, 1, parts, {"step": 1})
    take_steps(parts, 1)

    # The early check: the free space cannot hold another checkpoint the size of checkpoint-1.
    with pytest.raises(CheckpointSaveError) as early:
        save_checkpoint(run, 2, parts, {"step": 2})
    assert str(early.value).startswith(f"saving checkpoint-2 to {run} failed before writing: not enough free space")
    assert "; free space: " in str(early.value) and "the last complete checkpoint is checkpoint-1" in str(early.value)

    # Past the early check, the writers themselves hit the full disk.
    monkeypatch.setattr(ckpt, "checkpoint_bytes", lambda path: 0)
    with pytest.raises(CheckpointSaveError) as late:
        save_checkpoint(run, 2, parts, {"step": 2})
    message = str(late.value)
    assert message.startswith(f"saving checkpoint-2 to {run} failed: No space left on device"), message
    assert re.search(r"; free space: \d+ MB; the last complete checkpoint is checkpoint-1\. ", message), message
    assert "rerun with checkpoint.resume_from=auto" in message and "\n" not in message
    assert sorted(p.name for p in run.iterdir() if p.name != "lost+found") == ["checkpoint-1"]  # no .tmp left

    fresh = make_parts(tiny_text_dir)
    load_checkpoint(run / "checkpoint-1", fresh)  # the previous checkpoint is intact
    assert_same_tensors(fresh.student.state_dict(), make_loaded(tiny_text_dir, run / "checkpoint-1"))
    print(f"full disk: {'a 20 MB tmpfs' if mounted else 'simulated ENOSPC'}: {message}")


def make_loaded(tiny_text_dir, path):
    parts = make_parts(tiny_text_dir)
    load_checkpoint(path, parts)
    return parts.student.state_dict()


def test_the_first_save_onto_a_full_disk_names_the_cause_and_the_free_space_at_the_failure(tmp_path, tiny_text_dir, monkeypatch):
    """No earlier checkpoint to size the early check by: the writers themselves fill a 6 MB file system."""
    with small_file_system(tmp_path / "small", monkeypatch, size_mb=6) as (run, mounted):
        with pytest.raises(CheckpointSaveError) as err:
            save_checkpoint(run, 1, saved_parts(tiny_text_dir), {"step": 1})
        assert sorted(p.name for p in run.iterdir() if p.name != "lost+found") == []  # no .tmp left
    message = str(err.value)
    assert message.startswith(f"saving checkpoint-1 to {run} failed: No space left on device"), message
    if mounted:  # the free space when the write failed, not after the cleanup freed what the save took
        assert "; free space: 0 MB; the last complete checkpoint is none. " in message, message


def test_the_zip_writer_failing_on_a_full_disk_is_named_too(small_disk, tiny_text_dir, monkeypatch):
    """torch.save's writer reports a full disk as `unexpected pos`, with no OSError: the free space
    at the failure tells. The disk is really filled just before the RNG states are written."""
    run, mounted = small_disk
    if not mounted:
        pytest.skip("needs a small file system (mount -t tmpfs, as root)")
    save = ckpt.torch.save

    def onto_a_full_disk(obj, path, *args, **kwargs):
        if not hasattr(path, "write"):  # the RNG file (DCP saves into memory buffers first)
            fill(path.parent)  # inside the .tmp: the cleanup frees it again
        save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", onto_a_full_disk)
    with pytest.raises(CheckpointSaveError, match=r"failed: No space left on device \(RuntimeError: .*unexpected pos .*\); "
                                                  r"free space: 0 MB; the last complete checkpoint is none\."):
        save_checkpoint(run, 1, saved_parts(tiny_text_dir), {"step": 1})
    assert sorted(p.name for p in run.iterdir() if p.name != "lost+found") == []


def test_a_failure_that_is_not_the_disk_keeps_its_traceback_and_leaves_no_tmp(tmp_path, tiny_text_dir, monkeypatch):
    parts = saved_parts(tiny_text_dir)
    monkeypatch.setattr(ckpt, "_fault_point", lambda stage, step: 1 / 0 if stage == "train_state" else None)
    with pytest.raises(ZeroDivisionError):
        save_checkpoint(tmp_path, 1, parts, {"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_without_its_manifest_is_moved_aside_and_its_step_saves_again(tmp_path, tiny_text_dir, capsys):
    parts = saved_parts(tiny_text_dir)
    save_checkpoint(tmp_path, 1, parts, {"step": 1, "counters": {}, "config": {}})
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / ckpt.MANIFEST).unlink()  # a save that did not finish

    manager = CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path)
    assert manager.source.name == "checkpoint-1"
    aside = list(tmp_path.glob("checkpoint-2.incomplete-*"))
    assert len(aside) == 1 and (aside[0] / "model").is_dir()  # kept, renamed
    assert f"checkpoint: moved checkpoint-2 aside to {aside[0].name}: it has no manifest" in capsys.readouterr().out
    save_checkpoint(tmp_path, 2, parts, {"step": 2})  # no collision with the unfinished one
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


def test_a_corrupt_newest_checkpoint_names_the_newest_intact_one_and_how_to_continue(tmp_path, tiny_text_dir, capsys):
    parts = saved_parts(tiny_text_dir)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, parts, {"step": step, "counters": {}, "config": {}})
    shard = next((tmp_path / "checkpoint-3" / "train_state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])

    with pytest.raises(CheckpointError) as err:
        CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path)
    older = tmp_path / "checkpoint-2"
    assert f"The newest intact checkpoint is {older}: continue from it with checkpoint.resume_from={older} " \
           "checkpoint.discard_newer=true" in str(err.value)
    with pytest.raises(CheckpointError, match="set checkpoint.discard_newer=true to move them aside"):
        CheckpointManager(run_config(tmp_path, resume_from=str(older)), tmp_path)

    manager = CheckpointManager(run_config(tmp_path, resume_from=str(older), discard_newer=True), tmp_path)
    assert manager.source == older and manager.resume_step == 2
    aside = list(tmp_path.glob("checkpoint-3.discarded-*"))
    assert len(aside) == 1 and (aside[0] / "model").is_dir()  # never deleted
    assert "moved checkpoint-3 aside to checkpoint-3.discarded-" in capsys.readouterr().out
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


def test_discard_newer_needs_a_checkpoint_to_resume_from():
    from opsd.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.discard_newer needs checkpoint.resume_from"):
        run_config("runs/x", discard_newer=True)


def test_only_rank_0_speaks_for_the_checkpoints(tmp_path, monkeypatch, capsys):
    (tmp_path / "checkpoint-5.tmp").mkdir()
    monkeypatch.setenv("RANK", "1")  # as under torchrun, before the process group exists
    CheckpointManager(run_config(tmp_path / str(uuid.uuid4()), resume_from="auto"), tmp_path / "other")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path)
    assert "checkpoint: removed checkpoint-5.tmp" in capsys.readouterr().out


def test_a_warning_comes_one_save_before_the_disk_is_full(small_disk, tiny_text_dir, capsys):
    run, _ = small_disk
    manager = CheckpointManager(run_config(run), run)
    manager.start(saved_parts(tiny_text_dir))
    manager.save(1, {})
    out = capsys.readouterr().out
    assert f"checkpoint: WARNING: " in out and f"MB free in {run}, checkpoint-1 took 12 MB: the next save will not fit" in out


def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path, tiny_text_dir):
    parts = saved_parts(tiny_text_dir)
    with torch.no_grad():
        next(parts.student.parameters())[0] = float("nan")
    with pytest.raises(CheckpointError, match=r"not saving checkpoint-1: the student's .* holds non-finite values"):
        save_checkpoint(tmp_path, 1, parts, {"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_large_shard_changed_after_the_save_is_caught_by_its_hash(tmp_path, tiny_text_dir):
    """64 KiB of 0xFF inside a training-state shard of over 16 MiB (the size main checked by size only):
    the resume stops before loading it, naming the file and the newest intact checkpoint."""
    ballast = lambda model: model.register_parameter("ballast", torch.nn.Parameter(torch.randn(3_000_000)))  # noqa: E731
    parts = make_parts(tiny_text_dir, teacher_mode="self", wrap=ballast)
    take_steps(parts, 1)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, parts, {"step": step, "counters": {}, "config": {}})
    shard = max((tmp_path / "checkpoint-2" / "train_state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > 16 << 20
    with open(shard, "r+b") as f:  # inside the weights' bytes: the size stays, the content does not
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * (64 << 10))
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(run_config(tmp_path, resume_from="auto"), tmp_path)
    older = tmp_path / "checkpoint-1"
    assert str(err.value).startswith(f"checkpoint {tmp_path / 'checkpoint-2'} is corrupt: train_state/{shard.name} differs "
                                     "from the file that was saved (sha256). The newest intact checkpoint is "
                                     f"{older}: continue from it with checkpoint.resume_from={older}")


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_corrupt_model_directory_at_the_start_is_one_error_line_naming_the_file(damage, tmp_path, tiny_vlm_dir, grid_data_dir, capsys):
    import opsd.train

    model = tmp_path / "model"
    shutil.copytree(tiny_vlm_dir, model)
    weights = model / "model.safetensors"
    if damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 1000)
    else:
        weights.write_bytes(bytes(range(256)) * 64 + weights.read_bytes()[16384:])
    status = opsd.train.main(["--config", "configs/demo.yaml", f"model.path={model}", "model.build=null",
                              f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: model.path: {weights} is corrupt: ") and damage in err[0], err
