"""Run a function on 2 gloo ranks in spawned processes (`target(rank, port, *args)`), and fail on a crash or hang."""

import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(target, *args, timeout_s: float = 240) -> None:
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:  # a rank waiting in a collective the other never joins shows up as a timeout
        p.join(timeout=max(1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank crashed or hung"
