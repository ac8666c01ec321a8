"""Peak memory and time of the OPSD loss against a naive float32 full-vocabulary JSD.

Measures forward + backward of `opsd.loss.generalized_jsd` (top_k=256, beta=0.5, bf16 logits) and
of a naive implementation (upcast the whole [N, V] logits to float32, log_softmax, logsumexp
mixture, sum), side by side, at N tokens for each vocabulary size (32768, and 151936 = Qwen).
Each case runs in a fresh child process so that one case's allocations cannot hide another's peak.
Peak memory is the extra memory over the inputs (student and teacher bf16 logits) during forward +
backward, so it includes the [N, V] bf16 gradient of the student logits: on CPU the ru_maxrss
growth after the inputs exist, on CUDA torch.cuda.max_memory_allocated minus the allocation
before. Time is the median over --repeats runs after a small warm-up.

Run: .venv/bin/python bench/loss_memory.py [--device cpu] [--tokens 4096] [--vocab 32768 151936]
Prints one JSON object to stdout. Where the naive float32 run would not fit in the available
memory, N is halved for that vocabulary until it does (both measured there, side by side) and
opsd is additionally measured at the requested N.
"""

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opsd.loss import generalized_jsd  # noqa: E402

TOP_K, BETA = 256, 0.5
# Float32 [N, V] buffers the naive forward + backward holds at its peak (measured on CPU: ~11);
# used only to skip a case that would not fit.
NAIVE_F32_BUFFERS = 12


def naive_jsd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    log_s = F.log_softmax(student.float(), dim=-1)
    log_t = F.log_softmax(teacher.float(), dim=-1)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - BETA), log_t + math.log(BETA)]), dim=0)
    terms = BETA * log_t.exp() * (log_t - log_m) + (1 - BETA) * log_s.exp() * (log_s - log_m)
    return terms.sum(dim=-1)


def opsd_jsd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return generalized_jsd(student, teacher, beta=BETA, top_k=TOP_K)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _bf16_logits(n: int, v: int, device: str, seed: int) -> torch.Tensor:
    # Filled in row blocks: a one-shot float32 randn would leave a transient peak in ru_maxrss.
    gen = torch.Generator(device).manual_seed(seed)
    out = torch.empty(n, v, dtype=torch.bfloat16, device=device)
    for rows in out.split(256):
        rows.copy_(torch.randn(rows.shape, generator=gen, device=device) * 3)
    return out


def measure(impl: str, device: str, tokens: int, vocab: int, repeats: int) -> dict:
    """Runs in the child process."""
    fn = {"opsd": opsd_jsd, "naive": naive_jsd}[impl]
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm = torch.randn(8, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn(warm, warm.detach()).sum().backward()  # load kernels before the baseline
    student = _bf16_logits(tokens, vocab, device, 0).requires_grad_()
    teacher = _bf16_logits(tokens, vocab, device, 1)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mib()
    times = []
    for _ in range(repeats):
        student.grad = None
        start = time.perf_counter()
        fn(student, teacher).sum().backward()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mib()
    return {"peak_mib": round(peak - base, 1), "time_s": round(statistics.median(times), 3)}


def _available_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0] / 2**20
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return math.inf


def _naive_need_mib(tokens: int, vocab: int) -> float:
    return (NAIVE_F32_BUFFERS * 4 + 2 * 2) * tokens * vocab / 2**20  # float32 buffers + bf16 inputs


def _run_child(impl: str, device: str, tokens: int, vocab: int, repeats: int) -> dict:
    spec = json.dumps([impl, device, tokens, vocab, repeats])
    proc = subprocess.run(
        [sys.executable, __file__, "--child", spec], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--repeats", type=int, default=None, help="default: 5 on CUDA, 1 on CPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return
    args.repeats = args.repeats or (5 if args.device.startswith("cuda") else 1)

    results = []
    for vocab in args.vocab:
        # Halve N until the naive float32 run fits; opsd is then also measured at the requested N.
        tokens = args.tokens
        while tokens > 1 and _naive_need_mib(tokens, vocab) > 0.9 * _available_mib(args.device):
            tokens //= 2
        row = {"vocab": vocab, "tokens": tokens, "input_mib": round(4 * tokens * vocab / 2**20, 1)}
        row["opsd"] = _run_child("opsd", args.device, tokens, vocab, args.repeats)
        row["naive"] = _run_child("naive", args.device, tokens, vocab, args.repeats)
        if "peak_mib" in row["opsd"] and "peak_mib" in row["naive"]:
            row["memory_ratio"] = round(row["naive"]["peak_mib"] / row["opsd"]["peak_mib"], 2)
            row["time_ratio"] = round(row["naive"]["time_s"] / row["opsd"]["time_s"], 2)
        if tokens != args.tokens:
            row["note"] = (
                f"naive float32 at N={args.tokens} needs ~{_naive_need_mib(args.tokens, vocab):.0f} MiB,"
                f" more than available; both measured at N={tokens}"
            )
            full = _run_child("opsd", args.device, args.tokens, vocab, args.repeats)
            row[f"opsd_at_{args.tokens}_tokens"] = full
        results.append(row)
    print(json.dumps({
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "top_k": TOP_K,
        "beta": BETA,
        "dtype": "bfloat16",
        "repeats": args.repeats,
        "peak": "extra memory over the inputs during forward + backward, incl. the student's bf16 grad",
        "results": results,
    }))


if __name__ == "__main__":
    main()
