"""One run per output directory: a lock that a run holds on `<output_dir>/.opsd-run.lock`.

Two runs writing to one `logging.output_dir` destroy each other's history: both append to
`metrics.jsonl`, each one's rotation deletes the other's checkpoints, a start-up cleanup deletes the
other's half-written save. So a run takes an exclusive `flock` on the lock file before it touches the
directory, holds it until its process exits, and writes who holds it (pid, host, start time, command)
into the file; a second run is refused with one line naming the holder.

The kernel releases a `flock` when its process dies, however it dies (SIGKILL, out of memory), so a
lock is never left held by a dead run; a lock file whose content names a holder but whose lock is
free is what such a death leaves behind, and the next run says so and takes it over. `flock` works
on local file systems and on NFS (Linux emulates it with byte-range locks there). Under torchrun,
rank 0 holds it for the job. Stdlib only: the lock is taken before torch is imported.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".opsd-run.lock"


class OutputDirInUse(RuntimeError):
    """Another live run holds the output directory's lock; the message names it."""


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started} ({holder.get('command', '?')})"


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


@contextmanager
def output_dir_lock(output_dir: Path, say=lambda message: print(message, file=sys.stderr, flush=True)):
    """Hold the lock of `output_dir` (created when missing) for the `with` block; `OutputDirInUse`
    when another process holds it. `say` reports a stale lock left by a run that died."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            who = _describe(holder) if holder else "another process (it has not written its name yet)"
            raise OutputDirInUse(
                f"logging.output_dir {output_dir} is in use by another run: {who}; wait for it to end, stop it, "
                "or choose another logging.output_dir (two runs in one directory destroy each other's checkpoints "
                "and metrics)"
            ) from None
        stale = _read(fd)
        if stale:
            say(f"checkpoint: the run that held {path} ({_describe(stale)}) is no longer running (it did not "
                "exit cleanly); this run takes the directory over")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": " ".join(["python"] + sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode() + b"\n")
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a clean exit leaves an empty file: nothing stale to report
    finally:
        os.close(fd)  # releases the flock
