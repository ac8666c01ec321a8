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


class FakeCheckpoints:
    def __init__(self, last_saved_step):
        self.last_saved_step, self.saved = last_saved_step, []

    def save(self, step, record):
        self.saved.append(step)


def stopped_run(tmp_path, *, step, last_saved_step, save_on_signal=True):
    from types import SimpleNamespace

    from opsd.config import config_from_dict
    from opsd.train import stop_run
    from opsd.trainer.stop import StopRequest

    cfg = config_from_dict({"model": {"path": "m"}, "data": {"path": "d"},
                            "checkpoint": {"save_on_signal": save_on_signal}})
    run = SimpleNamespace(cfg=cfg, last_step=step, last_record={}, output_dir=tmp_path,
                          checkpoints=FakeCheckpoints(last_saved_step))
    stopped = stop_run(run, signal.SIGTERM, StopRequest(signum=signal.SIGTERM, at=time.monotonic()))
    return run.checkpoints.saved, stopped


@pytest.mark.parametrize("step, last_saved_step, save_on_signal, saved", [
    (4, 3, True, [4]),  # the last finished step is saved
    (3, 3, True, []),  # it was just saved (a save_every step, or the step a resume started from)
    (0, None, True, []),  # nothing ran
    (4, 3, False, []),  # checkpoint.save_on_signal=false
])
def test_the_stop_save_happens_once_and_only_when_asked(tmp_path, step, last_saved_step, save_on_signal, saved):
    done, stopped = stopped_run(tmp_path, step=step, last_saved_step=last_saved_step, save_on_signal=save_on_signal)
    assert done == saved
    assert stopped.signal_name == "SIGTERM" and stopped.step == step
    assert str(stopped).startswith(f"stopped by SIGTERM at step {step} (") and "no checkpoint was written" in str(stopped)
