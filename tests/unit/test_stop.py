"""Stop requests: what SIGTERM, SIGINT and SIGUSR1 do, without a run (a second signal: tests/integration/test_stop_signals.py)."""

import os
import signal
import time

import pytest
import torch

from opsd.trainer.distributed import Ranks
from opsd.trainer.stop import STOP_SIGNALS, StepStart, stop_on_signals
from tests.helpers.parts import make_parts


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


def test_a_dropped_step_leaves_the_data_position_and_the_random_streams_as_they_were(tiny_text_dir):
    stream = make_parts(tiny_text_dir).stream
    stream.take(2)
    start = StepStart.capture(stream)
    expected_next, expected_draw = stream.take(2), torch.rand(3)
    start.restore(stream)
    assert [s.id for s in stream.take(2)] == [s.id for s in expected_next]
    assert torch.equal(torch.rand(3), expected_draw)
