"""vLLM's engine start with and without the heap frozen first (opsd/rollout/vllm_engine.py), side by side.

Each setting runs in a child process of its own that holds what a training process holds before its
engine starts (opsd.train, the tiny VLM loaded by transformers), then times vLLM's `LLM(...)` and
its garbage collections. Prints one JSON object last.

    .venv/bin/python bench/engine_start.py [--model artifacts/tiny-vlm] [--repeats 2]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str, freeze: bool) -> dict:
    import gc

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import opsd.train  # noqa: F401 (the modules a training process holds)
    from transformers import AutoModelForImageTextToText
    from vllm import LLM

    held = AutoModelForImageTextToText.from_pretrained(model)  # noqa: F841 (the trainer's model)
    tracked = len(gc.get_objects())
    started = time.perf_counter()
    if freeze:
        gc.collect()
        gc.freeze()
    collections, collect = [], gc.collect

    def timed_collect(*args):
        t = time.perf_counter()
        result = collect(*args)
        collections.append(time.perf_counter() - t)
        return result

    gc.collect = timed_collect
    LLM(model=model, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=1024, limit_mm_per_prompt={"image": 2})
    return {"freeze_first": freeze, "objects_tracked": tracked, "start_s": time.perf_counter() - started,
            "collections": len(collections), "collections_s": sum(collections)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "artifacts/tiny-vlm"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["plain", "freeze"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child == "freeze")))
        return
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"error: --model {args.model}: no model there (make smoke builds artifacts/tiny-vlm)")
    runs = {"plain": [], "freeze": []}
    for _ in range(args.repeats):
        for name in runs:  # alternated, so that a slow spell of the machine hits both
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", name], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                                  capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {name: sorted(r["start_s"] for r in rs)[len(rs) // 2] for name, rs in runs.items()}
    print(json.dumps({"model": args.model, "runs": runs, "median_start_s": median,
                      "freeze_over_plain": median["freeze"] / median["plain"]}, indent=1))


if __name__ == "__main__":
    main()
