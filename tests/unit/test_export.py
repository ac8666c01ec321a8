"""`python -m opsd.export`: a verified, clean Hugging Face directory from a checkpoint."""

import pytest
import torch
from tests.helpers.parts import make_parts, take_steps
from transformers import AutoModelForCausalLM, AutoTokenizer

from opsd.export import export_checkpoint, main
from opsd.trainer.checkpoint import save_checkpoint


@pytest.fixture
def run(tmp_path, tiny_text_dir):
    """A run directory with checkpoints at steps 1 and 2, and the parts as of step 2."""
    parts = make_parts(tiny_text_dir)
    take_steps(parts, 1)
    save_checkpoint(tmp_path / "run", 1, parts, {"step": 1})
    take_steps(parts, 1)
    save_checkpoint(tmp_path / "run", 2, parts, {"step": 2})
    return tmp_path / "run", parts


def assert_loads_as(out, module):
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = module.state_dict()
    assert all(torch.equal(t, state[name]) for name, t in loaded.state_dict().items())
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_cli_exports_the_newest_student(run, tmp_path, capsys):
    run_dir, parts = run
    assert main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert "checkpoint-2" in capsys.readouterr().out
    assert_loads_as(tmp_path / "out", parts.student)
    assert not list(tmp_path.glob("*.tmp-export"))


def test_ema_export_takes_the_teacher(run, tmp_path):
    run_dir, parts = run
    export_checkpoint(run_dir / "checkpoint-2", tmp_path / "ema", ema=True)
    assert_loads_as(tmp_path / "ema", parts.teacher.module)


def test_refuses_non_empty_out_and_corrupt_checkpoints(run, tmp_path, capsys):
    run_dir, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err

    weights = run_dir / "checkpoint-2" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    assert main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    assert "model/model.safetensors has" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ema_export_needs_an_ema_teacher(tmp_path, tiny_text_dir, capsys):
    save_checkpoint(tmp_path / "run", 1, make_parts(tiny_text_dir, teacher_mode="self"), {"step": 1})
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--ema"]) == 2
    assert "has no EMA teacher" in capsys.readouterr().err


def test_exported_files_have_the_umask_modes(run, tmp_path):
    """safetensors writes 0600; an export is readable by others, as Hugging Face's own saves are (0644 under umask 022)."""
    import os

    run_dir, _ = run
    out = export_checkpoint(run_dir, tmp_path / "out")
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
