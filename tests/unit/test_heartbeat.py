"""The heartbeat between ranks, on a real c10d TCPStore in this process (no process group)."""

import time
from datetime import timedelta

import torch.distributed as dist

from opsd.trainer.heartbeat import Heartbeat
from tests.helpers.spawn import free_port


def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_silent_rank_is_named_within_the_timeout():
    shared, lost = store(), []
    rank0 = Heartbeat(0, 2, 1.0, store=shared, interval_s=0.1, on_lost=lost.append)
    rank1 = Heartbeat(1, 2, 1.0, store=shared, interval_s=0.1, on_lost=lost.append)
    time.sleep(0.5)
    assert lost == []  # both beat
    rank1._stop.set()  # rank 1's thread stops as a SIGSTOPped process would (no "done" mark)
    start = time.monotonic()
    assert wait_for(lambda: lost, 3)
    assert time.monotonic() - start < 1.0 + 0.5
    assert lost[0].startswith("error: rank 1 (pid ") and "stopped answering: no heartbeat for 1 s" in lost[0]
    assert "distributed.heartbeat_timeout_s=1" in lost[0]
    rank0.stop()


def test_a_rank_that_finished_is_not_blamed():
    shared, lost = store(), []
    rank0 = Heartbeat(0, 2, 0.5, store=shared, interval_s=0.1, on_lost=lost.append)
    rank1 = Heartbeat(1, 2, 0.5, store=shared, interval_s=0.1, on_lost=lost.append)
    rank1.stop()  # done: marks itself
    time.sleep(1.5)
    assert lost == []
    rank0.stop()


def test_a_rank_that_never_registered_counts_as_silent():
    lost = []
    rank0 = Heartbeat(0, 2, 0.5, store=store(), interval_s=0.1, on_lost=lost.append)
    assert wait_for(lambda: lost, 3) and "rank 1 (never started its heartbeat) stopped answering" in lost[0]
    rank0.stop()
