"""Where a step of the learning benchmark's recipe spends its time, and what the evaluation change buys.

In one process, on configs/learn_facts_smollm2.yaml (or --config), with the recipe's own stages
(opsd.train): start the run (engine, student, teacher), then time
- the held-out evaluation as it was (student prompts, then teacher prompts: two engine calls) and
  as it is (one call, each distinct prompt once), with privileged information and without it;
- `--steps` training steps stage by stage: rollout, sequences, scoring + backward + optimizer step
  (with the teacher update), weight sync; wall and process CPU seconds. Scoring runs twice on each
  step's sequences, as it was (every sequence its own prompt forward) and as it is (the samples of one
  prompt share its forward, `train.share_prompt_forward`), so the two are timed on the same tokens;
- the threads torch uses in the trainer once the engine has started.

    .venv/bin/python bench/step_profile.py [--steps 3] [key=value ...]

Prints one JSON object. Wall times on a loaded machine stretch; CPU seconds much less so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def timed(into: dict, key: str):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into.setdefault(key, []).append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})


def medians(samples: dict) -> dict:
    return {k: {m: statistics.median(s[m] for s in v) for m in ("wall_s", "cpu_s")} for k, v in samples.items()}


def profile(cfg, log_file, steps: int):
    """(evaluation timings, step stage timings, startup s, torch threads, eval items) of one started run."""
    import torch

    from opsd.evaluation import generate_once
    from opsd.prompts import placeholder_token_ids, student_prompt, teacher_prompt
    from opsd.rollout import SamplingSettings
    from opsd.rollout.weight_sync import sync_student
    from opsd.train import advance_schedules, build_sequences, end_run, sample, start_run, update_student

    started = time.perf_counter()
    run = start_run(cfg, log_file)
    startup_s = time.perf_counter() - started
    threads = torch.get_num_threads()

    evaluation: dict = {}
    settings = SamplingSettings.greedy(cfg.eval.max_new_tokens, placeholder_token_ids(run.processor))
    for label, prompt_cfg in (("privileged", cfg.prompts), ("no_privileged", dataclasses.replace(cfg.prompts, privileged=[]))):
        lists = [[render(s, run.processor, prompt_cfg) for s in run.evaluator.samples] for render in (student_prompt, teacher_prompt)]
        with timed(evaluation, f"{label}_two_calls"):
            for prompts in lists:
                generate_once([prompts], run.engine, settings)
        with timed(evaluation, f"{label}_one_call"):
            generate_once(lists, run.engine, settings)

    stages: dict = {}
    for step in range(1, steps + 1):
        with timed(stages, "rollout"):
            rollout = sample(run, step)
        with timed(stages, "sequences"):
            examples, _, step_tokens = build_sequences(run, rollout)
        for share, stage in ((False, "score_backward_optimizer_unshared"), (True, "score_backward_optimizer")):
            packing = cfg.train.max_forward_tokens if share else None  # train.share_prompt_forward
            run.step.scoring = dataclasses.replace(run.step.scoring, packed_row_tokens=packing)
            with timed(stages, stage):
                update_student(run, examples, step_tokens, None, rollout.samples[0])
                advance_schedules(run)
        with timed(stages, "weight_sync"):
            sync_student(run.student, run.engine, bucket_mb=cfg.rollout.sync_bucket_mb, lora_sync=cfg.rollout.lora_sync)
    end_run(run)

    return evaluation, stages, startup_s, threads, len(run.evaluator.samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/learn_facts_smollm2.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from opsd.config import load_config
    from opsd.trainer.console import third_party_output

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / args.config, [*args.overrides, f"logging.output_dir={tmp}", "logging.progress_bar=false"])
        with third_party_output(cfg.logging.output_dir, verbose=cfg.logging.verbose) as log_file:
            evaluation, stages, startup_s, threads, eval_items = profile(cfg, log_file, args.steps)
    evaluation, stages = medians(evaluation), medians(stages)
    unshared = stages.pop("score_backward_optimizer_unshared")
    before = {**stages, "score_backward_optimizer": unshared}  # the step as it was: no prompt sharing
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "startup_s": startup_s,
        "torch_threads_after_engine_start": threads,
        "eval_items": eval_items,
        "evaluation": evaluation,
        "evaluation_speedup": {  # as it was / as it is
            f"{label}_{measure}": evaluation[f"{label}_two_calls"][measure] / evaluation[f"{label}_one_call"][measure]
            for label in ("privileged", "no_privileged") for measure in ("wall_s", "cpu_s")
        },
        "step_median": stages,
        "step_median_wall_s": sum(s["wall_s"] for s in stages.values()),
        "step_median_before": before,
        "step_median_wall_s_before": sum(s["wall_s"] for s in before.values()),
        "scoring_speedup_from_prompt_sharing": {
            m: unshared[m] / stages["score_backward_optimizer"][m] for m in ("wall_s", "cpu_s")
        },
        "sequences_per_step": cfg.prompts_per_step * cfg.rollout.samples_per_prompt,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
