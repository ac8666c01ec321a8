"""A heartbeat between torchrun's ranks: a rank that stops answering fails the job in minutes.

A rank that is stopped (SIGSTOP, a debugger), frozen or cut off holds every other rank in its next
collective until the process group's timeout. Here each rank's thread bumps a counter in torchrun's
rendezvous store every `interval_s`, and watches the next rank's counter (a ring: every rank is
watched by one other). When the watched counter has not moved for `timeout_s`, the watcher prints
one `error:` line naming the rank and exits with `EXIT_RANK_LOST`; torchrun then stops the other
ranks (SIGTERM, then SIGKILL after its `--shutdown-timeout`, 30 s by default).

The thread runs beside whatever the main thread does (collectives, native code), so a busy rank
keeps beating; only a process that is not running at all falls silent.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from datetime import timedelta

EXIT_RANK_LOST = 4
"""Exit status of a rank that gave up on another one that stopped answering."""
DONE = b"done"


def _store_client(timeout_s: float):
    """A connection of our own to torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=max(timeout_s, 1.0)),
    )


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float, *, store=None, interval_s: float | None = None,
                 on_lost=None):
        """`store`: a c10d store (default: a connection to torchrun's); `on_lost(message)`: what a lost
        rank does to this one (default: print the message, exit with `EXIT_RANK_LOST`)."""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.on_lost = on_lost or _exit_lost
        self.interval_s = interval_s if interval_s is not None else max(0.2, timeout_s / 10)
        self.store = store if store is not None else _store_client(timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"opsd/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}/"
        self.watched = (rank + 1) % world_size
        self._stop = threading.Event()
        self.store.set(self._key(rank, "who"), f"pid {os.getpid()} on {socket.gethostname()}")
        self.store.set(self._key(rank), b"0")
        self._thread = threading.Thread(target=self._run, name="opsd-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # whatever way the process ends, its watcher stops waiting for it

    def _key(self, rank: int, what: str = "beat") -> str:
        return f"{self.prefix}{rank}/{what}"

    def stop(self) -> None:
        """This rank is done (finished or failed on its own): its watcher stops blaming it."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.stop)
        self._thread.join(timeout=self.interval_s + 5)
        try:
            self.store.set(self._key(self.rank), DONE)
        except Exception:  # the store may be gone already at the very end
            pass

    def _run(self) -> None:
        beats, last_seen, last_change, watching, store_error = 0, None, time.monotonic(), True, None
        while not self._stop.wait(self.interval_s):
            beats += 1
            try:
                self.store.set(self._key(self.rank), str(beats))
                watched = self._key(self.watched)
                # `get` would wait for a rank that has not registered yet: that counts as silence
                seen = (self.store.get(watched) if self.store.check([watched]) else None) if watching else DONE
                store_error = None
            except Exception as err:  # a store hiccup is a missed beat; a lasting one ends like silence
                seen, store_error = last_seen, err
            if seen == DONE:  # the watched rank finished (or failed) by itself: nothing to wait for
                watching = False
                continue
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif now - last_change > self.timeout_s:
                self._give_up(now - last_change, store_error)
                return

    def _give_up(self, silent_s: float, store_error: Exception | None) -> None:
        if store_error is not None:
            what = (f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                    f"stopped answering for {silent_s:.0f} s ({store_error})")
        else:
            try:
                key = self._key(self.watched, "who")
                who = self.store.get(key).decode() if self.store.check([key]) else "never started its heartbeat"
            except Exception:
                who = "process unknown"
            what = f"rank {self.watched} ({who}) stopped answering: no heartbeat for {silent_s:.0f} s"
        self.on_lost(
            f"error: {what} (distributed.heartbeat_timeout_s={self.timeout_s:g}): stopped, frozen or cut off; "
            f"giving up (status {EXIT_RANK_LOST}); resume with checkpoint.resume_from=auto once it is fixed"
        )


def _exit_lost(message: str) -> None:
    # The main thread may wait in a collective that never returns: exit from here, at once.
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)
