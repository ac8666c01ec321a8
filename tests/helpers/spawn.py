"""Run a function on 2 gloo ranks in fresh processes (`target(rank, port, *args)`), and fail on a crash or hang.

The ranks come from a forkserver that has imported torch, transformers and opsd once: a spawned rank
spends about 7 CPU seconds importing them, which on 2 cores is most of what a test costs. The server
is one single-threaded process per test process, started at the first use, so its forks are safe."""

import socket
import time

import torch.multiprocessing as mp

PRELOAD = ["torch.distributed.fsdp", "opsd.modeling", "opsd.scoring", "opsd.teacher", "opsd.loss_kinds",
           "opsd.trainer.step", "opsd.trainer.fsdp", "opsd.trainer.distributed", "opsd.rollout.weight_sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(target, *args, timeout_s: float = 240) -> None:
    ctx, port = mp.get_context("forkserver"), free_port()
    ctx.set_forkserver_preload(PRELOAD)
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
