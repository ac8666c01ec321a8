"""A second stop signal ends the process at once, even while its main thread is blocked."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from opsd.trainer.stop import EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[2]

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
