"""Settings of the recipe against each other, each as a few runs side by side, in one sitting.

Each `--setting NAME KEY=VALUE ...` runs `--at-once` recipe processes side by side (2: as
`bench/learning.py --tasks skill` runs them, one thread each), `--steps` steps, no evaluation unless
an override sets `eval.every`; then the next setting; with `--rounds 2` all again in the reverse
order. Per setting: the training stage's median from step 3 (the first steps fault the run's memory
in), steps 1-2, the sums of the training stages, rollouts and evaluations, and the processes' wall,
user and system seconds; the ratios of every setting to the first. The processes start without
glibc's malloc variables, so that the recipe makes its own choice (`train.keep_freed_memory`).

    .venv/bin/python bench/side_by_side.py --setting returned train.keep_freed_memory=false \\
        --setting kept train.keep_freed_memory=true [--rounds 2] [--steps 6] [--config X.yaml] [eval.every=3]
    .venv/bin/python bench/side_by_side.py --setting alone train.share_prompt_prefix=false \\
        --setting shared train.share_prompt_prefix=true --rounds 2

Prints one JSON object last.
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
sys.path.insert(0, str(ROOT))

from opsd.trainer.host_memory import without_malloc_settings  # noqa: E402


def run_together(config: str, name: str, overrides: list[str], steps: int, at_once: int, out: Path) -> list[dict]:
    """`at_once` recipe processes side by side; per process its step times and resource use."""
    env = without_malloc_settings()
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // at_once))
    children = []
    for i in range(at_once):
        run_dir = out / f"{name}-{i}"
        command = [sys.executable, "-m", "opsd.train", "--config", config, f"train.max_steps={steps}", "eval.every=0",
                   f"train.seed={i}", f"logging.output_dir={run_dir}", "logging.progress_bar=false",
                   "checkpoint.save_final=false", *overrides]
        log = open(out / f"{name}-{i}.log", "w")
        children.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), run_dir, log, time.perf_counter()))
    results = []
    for process, run_dir, log, start in children:
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        log.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"error: the run in {run_dir} failed (log: {log.name})")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results.append({"wall_s": wall, "user_s": usage.ru_utime, "system_s": usage.ru_stime,
                        **{f"{part}_s": [r[f"time_{part}_s"] for r in rows if f"time_{part}_s" in r]
                           for part in ("train", "rollout", "eval")}})
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
    parser.add_argument("--setting", nargs="+", action="append", required=True, metavar="NAME [KEY=VALUE]",
                        help="a name and the overrides of one setting (at least two settings)")
    parser.add_argument("--config", default="configs/learn_digits_smollm2_vlm.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--at-once", type=int, default=2, help="recipe processes side by side per setting")
    parser.add_argument("--rounds", type=int, default=1, help="2: every setting again, in the reverse order")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of every setting")
    args = parser.parse_args()
    settings = {name: overrides for name, *overrides in args.setting}
    if len(settings) < 2 or len(settings) != len(args.setting):
        parser.error("--setting: at least two, each with a name of its own")
    if args.steps < 3:
        parser.error("--steps: at least 3 (the median is taken from step 3)")
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="opsd-side-by-side-") as tmp:
        for round_ in range(args.rounds):
            order = list(settings) if round_ % 2 == 0 else list(reversed(settings))
            for name in order:
                out = Path(tmp) / f"round{round_}"
                out.mkdir(exist_ok=True)
                together = run_together(args.config, name, [*args.overrides, *settings[name]], args.steps, args.at_once, out)
                runs[name].extend(together)
                print(f"{name}, round {round_}: training stages " + "; ".join(
                    " ".join(f"{t:.1f}" for t in r["train_s"]) for r in together) + " s", flush=True)
    summaries = {name: summary(r) for name, r in runs.items()}
    first = next(iter(summaries))
    print(json.dumps({
        "command": " ".join(sys.argv), "config": args.config, "steps": args.steps, "at_once": args.at_once,
        "rounds": args.rounds, "settings": {name: {"overrides": settings[name], **summaries[name]} for name in settings},
        "runs": runs,
        "ratios": {f"{name}_over_{first}": {key: s[key] / summaries[first][key] for key in s if summaries[first][key]}
                   for name, s in summaries.items() if name != first},
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
    }))


if __name__ == "__main__":
    main()
