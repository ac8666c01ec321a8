"""Training steps on CPU with freed memory kept in the process (`train.keep_freed_memory`) and returned.

Each setting runs `--at-once` recipe processes side by side (2: as `bench/learning.py --tasks skill`
runs them, one thread each), `--steps` steps (no evaluation unless an override sets `eval.every`);
then the other setting, then (with `--rounds 2`) both again in the other order. Per setting: the
training stage's median from step 3 (the first steps fault the run's memory in whichever the
setting), steps 1-2, the sum of all, the rollout's and the evaluations' sums, and the processes'
wall, user and system seconds; the ratios kept / returned.

    .venv/bin/python bench/host_memory.py [--config configs/learn_digits_smollm2_vlm.yaml] [--steps 6] [--rounds 1] [eval.every=3]

Prints one JSON object last. What the setting saves depends on how the machine's kernel (and
hypervisor) hands out pages; on the 2-core CI machines system time took most of some steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"returned": "false", "kept": "true"}


def run_pair(config: str, keep: str, steps: int, at_once: int, out: Path, extra: list[str]) -> list[dict]:
    """`at_once` recipe processes side by side; per process its step times and resource use."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // at_once))
    children = []
    for i in range(at_once):
        run_dir = out / f"keep-{keep}-{i}"
        command = [sys.executable, "-m", "opsd.train", "--config", config, f"train.max_steps={steps}", "eval.every=0",
                   f"train.seed={i}", f"train.keep_freed_memory={keep}", f"logging.output_dir={run_dir}",
                   "logging.progress_bar=false", "checkpoint.save_final=false", *extra]
        log = open(out / f"keep-{keep}-{i}.log", "w")
        children.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), run_dir, log, time.perf_counter()))
    results = []
    for process, run_dir, log, start in children:
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        log.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"error: the run in {run_dir} failed (log: {log.name})")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r["time_train_s"] for r in rows if "time_train_s" in r]
        rollout = [r["time_rollout_s"] for r in rows if "time_rollout_s" in r]
        evals = [r["time_eval_s"] for r in rows if "time_eval_s" in r]
        results.append({"wall_s": wall, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
                        "train_s": train, "rollout_s": rollout, "eval_s": evals})
    return results


def summary(runs: list[dict]) -> dict:
    return {
        "train_median_from_step_3_s": statistics.median(t for r in runs for t in r["train_s"][2:]),
        "train_steps_1_2_s": statistics.mean(sum(r["train_s"][:2]) for r in runs),
        "train_sum_s": statistics.mean(sum(r["train_s"]) for r in runs),
        "rollout_sum_s": statistics.mean(sum(r["rollout_s"]) for r in runs),
        "eval_sum_s": statistics.mean(sum(r["eval_s"]) for r in runs),
        "wall_s": statistics.mean(r["wall_s"] for r in runs),
        "user_s": statistics.mean(r["user_s"] for r in runs),
        "system_s": statistics.mean(r["system_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/learn_digits_smollm2_vlm.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--at-once", type=int, default=2, help="recipe processes side by side per setting")
    parser.add_argument("--rounds", type=int, default=1, help="2: both settings again, in the other order")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps: at least 3 (the median is taken from step 3)")
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="opsd-host-memory-") as tmp:
        for round_ in range(args.rounds):
            order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                out = Path(tmp) / f"round{round_}"
                out.mkdir(exist_ok=True)
                pair = run_pair(args.config, SETTINGS[name], args.steps, args.at_once, out, args.overrides)
                runs[name].extend(pair)
                print(f"{name}, round {round_}: training stages " + "; ".join(
                    " ".join(f"{t:.1f}" for t in r["train_s"]) for r in pair) + " s", flush=True)
    settings = {name: summary(r) for name, r in runs.items()}
    kept, returned = settings["kept"], settings["returned"]
    print(json.dumps({
        "command": " ".join(sys.argv), "config": args.config, "steps": args.steps, "at_once": args.at_once,
        "rounds": args.rounds, "settings": settings, "runs": runs,
        "kept_over_returned": {key: kept[key] / returned[key] for key in kept if returned[key]},
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
    }))


if __name__ == "__main__":
    main()
