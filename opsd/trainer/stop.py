"""Stop requests: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 ask a run to stop cleanly.

SIGTERM is what Slurm and Kubernetes send on preemption or at the time limit (torchrun forwards it
to every rank), SIGUSR1 what Slurm's `--signal=USR1@<seconds>` sends ahead of it. A first signal
only sets the request: the training loop reads it at its next agreement point (all ranks together,
one collective), finishes or abandons the step, saves and exits with `EXIT_STOPPED`. A second
signal, more than `SAME_REQUEST_S` after the first, exits at once with 128 + its number.

The signals are read by a thread from Python's wakeup file descriptor, not by a Python handler on
the main thread: the main thread may sit in a collective or in native code for minutes, and the
second signal must still act at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from opsd.trainer.rng import rng_state, set_rng_state

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_STOPPED = 3
"""Exit status of a run stopped by a signal after its stop save: resume it with `checkpoint.resume_from=auto`."""
SAME_REQUEST_S = 1.0
"""Signals this close to the first one are the same request: a scheduler may signal torchrun and its
ranks alike, and torchrun forwards what it gets."""


class RunStopped(Exception):
    """Raised by `train` after a clean stop: saved (unless told not to), summary written, engine closed."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None, signalled_at: float | None):
        self.signal_name, self.step, self.checkpoint, self.signalled_at = signal_name, step, checkpoint, signalled_at
        super().__init__()

    @property
    def seconds_since_signal(self) -> float | None:
        """From the signal (as this rank received it) to now; None when only another rank received it."""
        return None if self.signalled_at is None else time.monotonic() - self.signalled_at

    def describe(self) -> dict:
        return {"signal": self.signal_name, "step": self.step, "checkpoint": self.checkpoint,
                "seconds_since_signal": self.seconds_since_signal}

    def __str__(self) -> str:
        seconds = self.seconds_since_signal
        after = f" ({seconds:.1f} s after the signal)" if seconds is not None else ""
        saved = f"the last checkpoint is {self.checkpoint}" if self.checkpoint else "no checkpoint was written"
        return f"stopped by {self.signal_name} at step {self.step}{after}; {saved}"


@dataclass
class StepStart:
    """The data position and this process's RNG states as a step starts: a step abandoned after its
    rollout is undone with them, so that its checkpoint is the one the previous step would have saved."""

    stream: dict
    rng: dict

    @classmethod
    def capture(cls, stream) -> "StepStart":
        return cls(stream.state_dict(), rng_state())

    def restore(self, stream) -> None:
        stream.load_state_dict(self.stream)
        set_rng_state(self.rng)


@dataclass
class StopRequest:
    """The first stop signal this process received (None: none yet) and when."""

    signum: int | None = None
    at: float | None = None
    """`time.monotonic()` at the first signal."""
    announce: bool = True
    """Say on stderr that the request was heard (rank 0)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self, ranks) -> int | None:
        """The stop signal when any rank received one (every rank calls this at the same point), else None."""
        signum = int(ranks.max([float(self.signum or 0)])[0])
        return signum or None

    def heard(self, signum: int, *, first_only: bool = False) -> None:
        """A stop signal arrived: the first sets the request, a later one (after the grace) exits now
        (`first_only`: only the first counts)."""
        name = signal.Signals(signum).name
        with self._lock:
            first = self.signum is None
            if first:
                self.signum, self.at = signum, time.monotonic()
        if first:
            if self.announce:
                _say(f"stop: {name} received: the run stops after the step in progress (one still sampling is "
                     f"dropped), saves and exits with status {EXIT_STOPPED}; send it again to exit at once without saving")
        elif not first_only and time.monotonic() - self.at > SAME_REQUEST_S:
            _say(f"stop: second {name}: exiting now without saving (status {128 + signum})")
            os._exit(128 + signum)


def _say(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a signal"


def _watch(request: StopRequest, read_fd: int) -> None:
    wanted = {int(s) for s in STOP_SIGNALS}
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:  # the write end was closed: the run is over
            return
        for signum in data:
            if signum in wanted:
                request.heard(signum)


@contextmanager
def stop_on_signals(*, announce: bool = True):
    """Turn SIGTERM, SIGINT and SIGUSR1 into a `StopRequest` for the duration (main thread only;
    elsewhere the request is never set and the signals keep their handlers)."""
    request = StopRequest(announce=announce)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    # The watcher acts; the handler only makes sure a first signal counts should something else take
    # the wakeup descriptor over (an asyncio loop in the main thread would).
    previous = {s: signal.signal(s, lambda signum, _: request.heard(signum, first_only=True)) for s in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(request, read_fd), name="opsd-stop-signals", daemon=True)
    watcher.start()
    try:
        yield request
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)
