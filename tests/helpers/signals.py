"""A stop signal sent from inside a training run, at a chosen stage of a chosen step (tests only).

`during("rollout", 5)` wraps `opsd.train.sample` so that step 5's rollout starts by signalling the
process (or its parent: torchrun, which forwards the signal to every rank, as a scheduler's SIGTERM
would reach them); `during("train", 5)` does the same at the start of step 5's update.
"""

import os
import signal
import time

import opsd.train

STAGE_FUNCTIONS = {"rollout": "sample", "train": "update_student"}


def during(stage: str, step: int, *, to: str = "self", signum: int = signal.SIGTERM, rank: int = 0):
    """(name in opsd.train, replacement) that signals `to` (self or parent) at `stage` of `step` on `rank`."""
    name = STAGE_FUNCTIONS[stage]
    real = getattr(opsd.train, name)

    def signalling(run, *args, **kwargs):
        if run.last_step + 1 == step and run.ranks.rank == rank:
            signalling.sent_at = time.monotonic()
            if to == "parent":
                signal_parent_and_wait(signum)
            else:
                os.kill(os.getpid(), signum)
        return real(run, *args, **kwargs)

    signalling.sent_at = None
    return name, signalling


def from_env(value: str | None):
    """`OPSD_TEST_SIGNAL=<stage>@<step>[:parent]` -> `during(...)`, or None."""
    if not value:
        return None
    where, _, to = value.partition(":")
    stage, _, step = where.partition("@")
    return during(stage, int(step), to=to or "self")


def signal_parent_and_wait(signum: int, timeout_s: float = 60.0) -> None:
    """Signal the parent and return once it has forwarded the signal here (this process's own handler
    ran): on a loaded machine torchrun can take longer to forward it than a tiny model's stage takes."""
    arrived = []
    handler = signal.getsignal(signum)

    def noting(number, frame):
        arrived.append(number)
        if callable(handler):
            handler(number, frame)

    signal.signal(signum, noting)
    try:
        os.kill(os.getppid(), signum)
        deadline = time.monotonic() + timeout_s
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signum, handler)
    if arrived and not callable(handler):
        os.kill(os.getpid(), signum)  # no Python handler: the signal's default action, as without the wait
