"""Stop requests: what SIGTERM, SIGINT and SIGUSR1 do to a run, without a run."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from opsd.trainer.distributed import Ranks
from opsd.trainer.stop import EXIT_STOPPED, STOP_SIGNALS, StepStart, stop_on_signals
from tests.helpers.parts import make_parts

ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_a_stop_signal_sets_the_request_and_the_handlers_come_back(signum, capfd):
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with stop_on_signals() as stop:
        assert not stop.requested and stop.agreed(Ranks()) is None
        os.kill(os.getpid(), signum)
        assert wait_for(lambda: stop.requested)
        assert stop.agreed(Ranks()) == signum
        os.kill(os.getpid(), signum)  # the same request within a second: nothing happens
        time.sleep(0.1)
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    assert f"stop: {signal.Signals(signum).name} received" in capfd.readouterr().err


SCRIPT = """
    import os, sys, time
    from opsd.trainer.stop import stop_on_signals
    with stop_on_signals() as stop:
        print("ready", flush=True)
        read_fd, _ = os.pipe()
        os.read(read_fd, 1)  # the main thread blocks in a system call, as in a collective that hangs
"""


def test_a_second_signal_exits_at_once_even_while_the_main_thread_is_blocked():
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # within a second of the first: the same request (torchrun forwarding)
    time.sleep(1.2)
    assert proc.poll() is None
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)  # later: a person insisting
    assert proc.wait(timeout=10) == 128 + signal.SIGINT
    assert time.monotonic() - start < 2.0
    err = proc.stderr.read()
    assert "stop: SIGTERM received" in err and f"status {EXIT_STOPPED}" in err
    assert "stop: second SIGINT: exiting now without saving (status 130)" in err


def test_a_dropped_step_leaves_the_data_position_and_the_random_streams_as_they_were(tiny_text_dir):
    stream = make_parts(tiny_text_dir).stream
    stream.take(2)
    start = StepStart.capture(stream)
    expected_next, expected_draw = stream.take(2), torch.rand(3)
    start.restore(stream)
    assert [s.id for s in stream.take(2)] == [s.id for s in expected_next]
    assert torch.equal(torch.rand(3), expected_draw)
