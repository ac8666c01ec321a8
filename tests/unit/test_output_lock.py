"""One run per output directory: the lock a run holds, what a second run is told, a stale lock."""

import os
import signal
import subprocess
import sys

import pytest

import opsd.train
from opsd.trainer.output_lock import LOCK_FILE, OutputDirInUse, output_dir_lock
from tests.helpers.parts import run_config

HOLD = "from opsd.trainer.output_lock import output_dir_lock; import sys, time\n" \
       "with output_dir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)\n"


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_named_and_replaced(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse) as err:
            with output_dir_lock(tmp_path):
                pass
        assert str(err.value).startswith(f"logging.output_dir {tmp_path} is in use by another run: pid {holder.pid} on ")
        assert "choose another logging.output_dir" in str(err.value) and "\n" not in str(err.value)
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel releases its flock; its name stays in the file
        holder.wait()
    said = []
    with output_dir_lock(tmp_path, say=said.append):
        assert str(os.getpid()) in (tmp_path / LOCK_FILE).read_text()
    assert len(said) == 1 and f"pid {holder.pid} on " in said[0] and "is no longer running" in said[0]
    with output_dir_lock(tmp_path, say=said.append):  # a clean exit leaves nothing stale
        pass
    assert len(said) == 1


def test_a_refused_run_touches_nothing_of_the_running_one(tmp_path):
    """Not the in-flight save (start-up cleanup), not metrics.jsonl: the run stops before them, status 2."""
    run = tmp_path / "run"
    (run / "checkpoint-5.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with output_dir_lock(run):  # the running one (this process, another open file: flock still refuses)
        with pytest.raises(OutputDirInUse, match=f"pid {os.getpid()} on "):
            opsd.train.train(run_config(run, resume_from="auto"))
    assert (run / "checkpoint-5.tmp").is_dir() and (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / "run.log").exists()
