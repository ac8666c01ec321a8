"""Checkpoints in real runs (tiny VLM, float32, CPU): exact resume, SIGKILL in the middle of a save,
stop signals, rotation keeping the best, and the checkpoint's model directory in transformers and vLLM."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers.logprobs import TOLERANCE, engine_logprobs, sample_grid_eval_prompts, trainer_logprobs
from tests.helpers import signals
from tests.helpers.datafiles import write_text_jsonl
from tests.helpers.parts import make_parts
from tests.helpers.runs import assert_same_steps, train_until_crash
from transformers import AutoModelForImageTextToText, AutoProcessor

import opsd.train
from opsd.config import load_config
from opsd.trainer import checkpoint as ckpt
from opsd.trainer.checkpoint import list_checkpoints, load_checkpoint, read_trainer_state
from opsd.trainer.stop import EXIT_STOPPED

REPO = Path(__file__).parents[2]


def overrides(output_dir, tiny_vlm_dir, grid_data_dir, *extra):
    return [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={output_dir}",
        "logging.progress_bar=false", "rollout.max_new_tokens=16", "train.max_steps=6", "checkpoint.save_every=3",
        "checkpoint.resume_from=null", "checkpoint.save_total_limit=null", *extra,
    ]


def run_config(output_dir, tiny_vlm_dir, grid_data_dir, *extra):
    return load_config(REPO / "configs/demo.yaml", overrides(output_dir, tiny_vlm_dir, grid_data_dir, *extra))


def read_metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_weights(path):
    return {role: load_file(path / role / "model.safetensors") for role in ("model", "teacher")}


def assert_same_weights(a, b):
    for role in a:
        assert a[role].keys() == b[role].keys()
        assert all(torch.equal(a[role][k], b[role][k]) for k in a[role]), role


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_vlm_dir, grid_data_dir):
    """6 steps without interruption; keeps the trainer's final student and EMA teacher."""
    output_dir = tmp_path_factory.mktemp("straight") / "run"
    captured = {}

    def capture_teacher(cfg, student, *copy_student):
        teacher = make_teacher(cfg, student, *copy_student)
        captured["student"], captured["teacher"] = student, teacher.module  # the EMA copy
        return teacher

    make_teacher = opsd.train.make_teacher
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opsd.train, "make_teacher", capture_teacher)
        opsd.train.train(run_config(output_dir, tiny_vlm_dir, grid_data_dir))
    return output_dir, captured


@pytest.mark.vllm
@pytest.mark.slow
def test_resume_continues_exactly(straight_run, tmp_path, tiny_vlm_dir, grid_data_dir, monkeypatch):
    """6 steps straight == 3 steps, a crash one step after checkpoint-3, a resume, 3 more steps."""
    reference_dir, _ = straight_run
    output_dir = tmp_path / "run"
    train_until_crash(run_config(output_dir, tiny_vlm_dir, grid_data_dir), 4, monkeypatch)
    assert [c.step for c in list_checkpoints(output_dir)] == [3]
    assert [r["step"] for r in read_metrics(output_dir)] == [0, 1, 2, 3, 4]  # 0: the baseline evaluation

    opsd.train.train(run_config(output_dir, tiny_vlm_dir, grid_data_dir, "checkpoint.resume_from=auto"))

    records = read_metrics(output_dir)  # step 4 of the crashed run is replaced, not duplicated
    assert_same_steps(records, read_metrics(reference_dir))
    assert records[4]["step"] == 4 and records[4]["logprob_mismatch_max"] < 1e-3  # the engine got the restored weights
    assert_same_weights(checkpoint_weights(output_dir / "checkpoint-6"), checkpoint_weights(reference_dir / "checkpoint-6"))
    assert read_trainer_state(output_dir / "checkpoint-6")["data_stream"] == read_trainer_state(reference_dir / "checkpoint-6")["data_stream"]


@pytest.mark.vllm
@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_previous_checkpoint(straight_run, tmp_path, tiny_vlm_dir, grid_data_dir):
    reference_dir, _ = straight_run
    output_dir = tmp_path / "run"
    # The final save is killed after its model directories and training state are written,
    # before the manifest and the rename.
    env = {**os.environ, "OPSD_FAULT_INJECT": "save:train_state@6"}
    args = ["--config", "configs/demo.yaml", *overrides(output_dir, tiny_vlm_dir, grid_data_dir)]
    proc = subprocess.run([sys.executable, "-m", "opsd.train", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (output_dir / "checkpoint-6.tmp" / "train_state" / ".metadata").is_file()
    assert [c.step for c in list_checkpoints(output_dir)] == [3]

    opsd.train.train(run_config(output_dir, tiny_vlm_dir, grid_data_dir, "checkpoint.resume_from=auto"))
    assert not (output_dir / "checkpoint-6.tmp").exists()
    assert [c.step for c in list_checkpoints(output_dir)] == [3, 6]
    # A fresh process resumed from checkpoint-3 and still took exactly the uninterrupted run's steps.
    assert_same_steps(read_metrics(output_dir), read_metrics(reference_dir))
    assert_same_weights(checkpoint_weights(output_dir / "checkpoint-6"), checkpoint_weights(reference_dir / "checkpoint-6"))


@pytest.mark.vllm
def test_checkpoint_model_dir_loads_in_transformers_and_vllm(straight_run, grid_data_dir):
    reference_dir, trained = straight_run
    model_dir = reference_dir / "checkpoint-6" / "model"
    processor = AutoProcessor.from_pretrained(model_dir)
    loaded = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    for role, model in (("model", loaded), ("teacher", AutoModelForImageTextToText.from_pretrained(model_dir.parent / "teacher"))):
        state = trained["student" if role == "model" else "teacher"].state_dict()
        assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items()), role

    prompts, completions = sample_grid_eval_prompts(model_dir, processor, grid_data_dir)
    from_engine = engine_logprobs(completions)
    from_trainer = trainer_logprobs(trained["student"], processor, prompts, completions)
    from_transformers = trainer_logprobs(loaded, processor, prompts, completions)
    assert (from_engine - from_trainer).abs().max() < TOLERANCE
    assert (from_transformers - from_trainer).abs().max() < TOLERANCE


def test_rotation_keeps_the_best_checkpoint(tmp_path, tiny_vlm_dir, grid_data_dir):
    # `lr` as the metric makes the best step known in advance: two warm-up steps (half the lr at step 1),
    # the peak at step 2, cosine decay after. Checkpoint-2 must outlive checkpoints 1 and 3.
    output_dir = tmp_path / "run"
    cfg = run_config(
        output_dir, tiny_vlm_dir, grid_data_dir, "rollout.engine=hf", "rollout.max_new_tokens=8",
        "train.max_steps=4", "optim.warmup_steps=2", "checkpoint.save_every=1", "checkpoint.save_total_limit=1",
        "checkpoint.metric_for_best_model=lr", "checkpoint.greater_is_better=true",
    )
    opsd.train.train(cfg)
    lrs = {r["step"]: r["lr"] for r in read_metrics(output_dir) if r["step"] > 0}
    assert max(lrs, key=lrs.get) == 2
    assert [c.step for c in list_checkpoints(output_dir)] == [2, 4]
    best = read_trainer_state(output_dir / "checkpoint-4")["best"]
    assert best == {"metric": "lr", "value": lrs[2], "step": 2, "checkpoint": "checkpoint-2"}


def test_a_run_whose_disk_fills_ends_with_one_error_line_and_the_last_checkpoint_loads(small_disk, tmp_path, tiny_text_dir,
                                                                                       monkeypatch, capfd):
    """The tiny text model saves every step onto a 20 MB file system: checkpoint-1 (12 MB) fits, checkpoint-2
    does not. With the early free-space check out of the way, the writers themselves meet the full disk."""
    output_dir, _ = small_disk
    data = write_text_jsonl(tmp_path / "train.jsonl", n_good=8, defects=[])
    monkeypatch.setattr(ckpt, "checkpoint_bytes", lambda path: 0)  # the early check would stop before writing
    args = ["--config", str(REPO / "configs/demo.yaml"), f"model.path={tiny_text_dir}", "data.path=null", "data.synthetic=null",
            f"data.datasets=[{{path: {data}, schema: text}}]", "prompts.privileged=[text]", "rollout.engine=hf",
            "rollout.max_new_tokens=4", "eval.every=0", f"logging.output_dir={output_dir}", "logging.progress_bar=false",
            "rollout.samples_per_prompt=1", "train.grad_accum_steps=1", "train.max_steps=2", "checkpoint.save_every=1",
            "checkpoint.resume_from=null"]
    assert opsd.train.main(args) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: saving checkpoint-2 to {output_dir} failed: No space left on device"), err
    assert "; the last complete checkpoint is checkpoint-1. " in err[0]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]  # no checkpoint-2.tmp
    load_checkpoint(output_dir / "checkpoint-1", make_parts(tiny_text_dir))  # verified file by file, then loaded


def test_cli_reports_checkpoint_errors(tmp_path, tiny_vlm_dir, grid_data_dir, capsys):
    args = ["--config", "configs/demo.yaml", *overrides(tmp_path, tiny_vlm_dir, grid_data_dir, f"checkpoint.resume_from={tmp_path / 'nowhere'}")]
    assert opsd.train.main(args) == 2
    assert "no opsd checkpoint at" in capsys.readouterr().err


STOP_BOUND_S = 90
"""Signal to exit of a stop on the tiny VLM: the rest of the stage (a rollout, or an update and its
weight sync), one save and the engine's close; seconds on a loaded 2-core machine, with room."""


@pytest.mark.vllm
@pytest.mark.slow
def test_stop_signals_save_and_the_resumes_end_as_the_uninterrupted_run(straight_run, tmp_path, tiny_vlm_dir, grid_data_dir,
                                                                        monkeypatch, capsys):
    """SIGTERM during step 5's rollout: the step is dropped, checkpoint-4 written, status 3. Resumed, SIGTERM
    during step 5's update: the step is finished and saved. Then a checkpoint-6 without its manifest (an
    unfinished save) stands in the way: the last resume moves it aside instead of colliding with it, and
    the three pieces end bit for bit where the uninterrupted run did."""
    reference_dir, _ = straight_run
    output_dir = tmp_path / "run"
    args = ["--config", str(REPO / "configs/demo.yaml"),
            *overrides(output_dir, tiny_vlm_dir, grid_data_dir, "checkpoint.resume_from=auto")]

    def stopped_run(stage, step):
        name, signalling = signals.during(stage, step)
        with monkeypatch.context() as patch:
            patch.setattr(opsd.train, name, signalling)
            assert opsd.train.main(args) == EXIT_STOPPED
        seconds = time.monotonic() - signalling.sent_at
        with capsys.disabled():
            print(f"\nSIGTERM during step {step}'s {stage}: {seconds:.1f} s from the signal to the exit")
        assert seconds < STOP_BOUND_S
        return capsys.readouterr()

    out = stopped_run("rollout", 5)
    assert "stopped by SIGTERM at step 4" in out.err and "the last checkpoint is checkpoint-4" in out.err
    assert [c.step for c in list_checkpoints(output_dir)] == [3, 4]
    assert [r["step"] for r in read_metrics(output_dir)] == [0, 1, 2, 3, 4]  # nothing of the dropped step
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["stopped"]["signal"] == "SIGTERM" and summary["stopped"]["step"] == 4

    out = stopped_run("train", 5)
    assert "stopped by SIGTERM at step 5" in out.err
    assert [c.step for c in list_checkpoints(output_dir)] == [3, 4, 5]

    shutil.copytree(output_dir / "checkpoint-5", output_dir / "checkpoint-6")
    (output_dir / "checkpoint-6" / "opsd_checkpoint.json").unlink()
    assert opsd.train.main(args) == 0
    assert "moved checkpoint-6 aside to checkpoint-6.incomplete-" in capsys.readouterr().out
    assert len(list(output_dir.glob("checkpoint-6.incomplete-*"))) == 1
    assert_same_steps(read_metrics(output_dir), read_metrics(reference_dir))
    assert_same_weights(checkpoint_weights(output_dir / "checkpoint-6"), checkpoint_weights(reference_dir / "checkpoint-6"))
