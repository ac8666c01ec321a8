"""The training stage against its floor, the rollout against vLLM called directly, in the same run.

Every setting runs in a child process of its own (one model in memory at a time): the recipe's run
is started as `opsd.train` starts it, then each step, on the same data,
- rollout: `opsd.pipeline.sample_rollout` of the step's samples (what `time_rollout_s` times, less
  taking the samples from the data stream) and vLLM's own `LLM.generate` of the same token ids with
  the same `SamplingParams`, called directly; the engine's caches (prefix, encoder, multimodal
  inputs) reset before each, so that neither reuses the other's work;
- training stage: `opsd.train.training_stage`, the function `train()` runs, timed by the same
  `StageTimer` (its `record()` is what metrics.jsonl gets: `time_train_s` and the parts
  `time_train/<part>_s`), and its floor on the same examples: for each micro-batch, a bare teacher
  forward without grad plus a student forward and backward of the same collated tensors (packed
  rows where prompts are shared), LM head on the completion positions, same dtype (autocast) and
  threads. The two alternate which goes first from step to step;
- the weight sync, so that the next step samples from the new weights.
Medians over `--steps` steps after `--warmup` steps; wall and process CPU seconds side by side.

A last child scores one step's teacher sequences (`teacher.mode: self`) twice: the trainer's teacher
forward with the top-k of its log-softmax, and the colocated engine's `prompt_logprobs` (top-k per
position, `max_logprobs` raised), for k = 20 and the recipe's top-k: seconds and the largest
difference of the top-k logprobs.

    .venv/bin/python bench/step_profile.py                           # every setting, 2 steps each after 1 warm-up
    .venv/bin/python bench/step_profile.py --settings smollm2-float32-4 --steps 3
    .venv/bin/python bench/step_profile.py --config configs/learn_facts_smollm2.yaml --steps 2 [key=value ...]

Prints one JSON object last. Wall times on a loaded machine stretch (the load average is recorded);
the ratios are measured side by side, step by step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "configs/text_opsd_smollm2.yaml"
SETTINGS = {  # name -> (config, overrides)
    "smollm2-float32-1": (SMOLLM2, ["rollout.samples_per_prompt=1"]),
    "smollm2-float32-4": (SMOLLM2, ["rollout.samples_per_prompt=4"]),
    "smollm2-bfloat16-1": (SMOLLM2, ["rollout.samples_per_prompt=1", "model.dtype=bfloat16"]),
    "smollm2-bfloat16-4": (SMOLLM2, ["rollout.samples_per_prompt=4", "model.dtype=bfloat16"]),
    "tiny-vlm-float32-2": ("configs/smoke.yaml", []),
}
ENGINE_LOGPROBS = "engine-teacher-logprobs"
TARGETS = {"smollm2": 1.15, "tiny-vlm": 1.3}
"""Acceptance (issue #19): training stage over its floor."""
PARTS_TOLERANCE = 0.05
"""The named parts add up to `time_train_s` within this fraction."""


@contextmanager
def timed(into: dict, key: str):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into[key] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def direct_requests(engine, prompts) -> list:
    """The requests opsd's engine sends, built as a user of `LLM.generate` would: token ids of text
    prompts (the trainer's tokenisation), the text and images of image prompts."""
    return [{"prompt": p.text, "multi_modal_data": {"image": p.images}} if p.images
            else {"prompt_token_ids": engine.tokenizer(p.text, add_special_tokens=False)["input_ids"]} for p in prompts]


def floor(run, examples) -> dict:
    """Wall and CPU seconds of the bare forwards and backward of the step's micro-batches."""
    import torch

    from opsd.scoring import autocast, completion_logits
    from opsd.trainer.step import micro_batches

    scoring, student, teacher = run.step.scoring, run.student, run.step.teacher
    device = next(student.parameters()).device
    batches = []
    for micro in micro_batches(examples, scoring.micro_batch_size, run.ranks, None):
        completions = [e.completion_ids for e in micro]
        batches.append((scoring.batch(student, [e.student for e in micro], completions),
                        scoring.batch(teacher, [e.teacher for e in micro], completions)))
    student.train()
    out: dict = {}
    with timed(out, "floor"):
        for student_batch, teacher_batch in batches:
            with autocast(device, scoring.dtype):
                logits = completion_logits(student, student_batch)
                with torch.no_grad():
                    completion_logits(teacher, teacher_batch)
            logits.backward(torch.ones_like(logits))
    run.optimizer.zero_grad(set_to_none=True)
    return out["floor"]


def profile_setting(cfg, log_file, steps: int, warmup: int) -> dict:
    """Runs in the child: the measured steps of one started run."""
    import torch
    from vllm import SamplingParams

    from opsd.pipeline import sample_rollout
    from opsd.prompts import student_prompt
    from opsd.rollout import sampling_settings
    from opsd.rollout.vllm_args import sampling_params
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.vllm_reload import reset_caches
    from opsd.rollout.weight_sync import sync_student
    from opsd.train import build_sequences, end_run, start_run, training_stage
    from opsd.trainer.metrics import StageTimer

    started = time.perf_counter()
    run = start_run(cfg, log_file)
    startup_s = time.perf_counter() - started
    threads = torch.get_num_threads()
    engine = run.engine
    against_vllm = isinstance(engine, VLLMEngine)  # the direct comparison needs vLLM's own LLM
    rows = []
    for index in range(warmup + steps):
        step, row, first = index + 1, {}, index % 2  # which of each pair goes first alternates
        settings = sampling_settings(cfg, step, run.processor)
        samples = run.stream.take(cfg.prompts_per_step)  # what `opsd.train.sample` takes, outside the timing
        if against_vllm:
            requests = direct_requests(engine, [student_prompt(s, run.processor, cfg.prompts) for s in samples])
            params = [SamplingParams(**sampling_params(settings, i), skip_special_tokens=True) for i in range(len(requests))]

        def ours():
            if against_vllm:
                reset_caches(engine.llm)
            with timed(row, "rollout"):
                row["completions"] = sample_rollout(engine, samples, run.processor, cfg, step)

        def direct():
            reset_caches(engine.llm)
            with timed(row, "direct_vllm"):
                engine.llm.generate(requests, params, use_tqdm=False)

        for fn in ((ours, direct) if first == 0 else (direct, ours)) if against_vllm else (ours,):
            fn()
        rollout = row.pop("completions")
        examples, _, _ = build_sequences(run, rollout)  # the floor's copy of what the stage builds

        timer = StageTimer()

        def stage():
            with timed(row, "stage"):
                training_stage(run, rollout, step, timer)

        def bare():
            row["floor"] = floor(run, examples)

        for fn in ((stage, bare) if first == 0 else (bare, stage)):
            fn()
        record = timer.record()  # what train() writes to metrics.jsonl
        row["time_train_s"] = record["time_train_s"]
        row["parts"] = {key[len("time_train/"):-2]: value for key, value in record.items() if key.startswith("time_train/")}
        row["completion_tokens"] = sum(len(c.token_ids) for c in rollout.completions)
        with timed(row, "weight_sync"):
            sync_student(run.student, engine, bucket_mb=cfg.rollout.sync_bucket_mb, lora_sync=cfg.rollout.lora_sync, exclude=run.frozen)
        if index >= warmup:
            rows.append(row)
        parts = " ".join(f"{name} {seconds:.2f}" for name, seconds in row["parts"].items())
        print(f"step {step}: stage {row['time_train_s']:.2f} s ({parts}), floor {row['floor']['wall_s']:.2f} s, rollout "
              f"{row['rollout']['wall_s']:.2f} s" + (f", direct vLLM {row['direct_vllm']['wall_s']:.2f} s" if against_vllm else ""),
              file=sys.stderr, flush=True)
    end_run(run)
    return summarise(rows, startup_s, threads)


def summarise(rows: list[dict], startup_s: float, threads: int) -> dict:
    stage = [r["time_train_s"] for r in rows]
    parts = {name: median([r["parts"].get(name, 0.0) for r in rows]) for name in dict.fromkeys(k for r in rows for k in r["parts"])}
    unaccounted = [r["time_train_s"] - sum(r["parts"].values()) for r in rows]

    def pair(key):
        return {m: median([r[key][m] for r in rows]) for m in ("wall_s", "cpu_s")}

    return {
        "steps": len(rows),
        "startup_s": startup_s,
        "torch_threads_after_engine_start": threads,
        "completion_tokens": median([r["completion_tokens"] for r in rows]),
        "stage_s": median(stage),
        "stage_cpu_s": pair("stage")["cpu_s"],
        "floor_s": pair("floor")["wall_s"],
        "floor_cpu_s": pair("floor")["cpu_s"],
        # per step, then the median: each ratio is of a pair measured back to back
        "stage_over_floor": median([r["time_train_s"] / r["floor"]["wall_s"] for r in rows]),
        "stage_over_floor_cpu": median([r["stage"]["cpu_s"] / r["floor"]["cpu_s"] for r in rows]),
        "parts": parts,
        "unaccounted_s": median(unaccounted),
        "parts_sum_over_time_train": median([sum(r["parts"].values()) / r["time_train_s"] for r in rows]),
        "rollout": pair("rollout"),
        "weight_sync": pair("weight_sync"),
        **({"direct_vllm": pair("direct_vllm"),
            "rollout_over_direct_vllm": median([r["rollout"]["wall_s"] / r["direct_vllm"]["wall_s"] for r in rows])}
           if "direct_vllm" in rows[0] else {}),  # a vLLM engine only
    }


def engine_teacher_logprobs(cfg, log_file, repeats: int) -> dict:
    """Runs in the child: the trainer's teacher top-k logprobs vs the engine's prompt logprobs."""
    import torch
    from vllm import SamplingParams

    from opsd.data.dataset import split_samples
    from opsd.modeling import load_model, load_processor, prepare_model_dir
    from opsd.pipeline import rollout_examples, sample_rollout
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import sync_student
    from opsd.scoring import Scoring, completion_logits
    from opsd.trainer.console import native_output_to_log
    from opsd.trainer.step import micro_batches
    from opsd.trainer.rng import seed_everything
    from opsd.trainer.distributed import Ranks

    ks = sorted({20, cfg.loss.top_k})
    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    with native_output_to_log(log_file):
        engine = VLLMEngine(dataclasses.replace(VLLMOptions.from_config(cfg, model_dir), max_logprobs=max(ks)))
    seed_everything(cfg.train.seed)
    student = load_model(cfg.model, processor, torch.device("cpu"))
    sync_student(student, engine)  # teacher = the engine's current weights = the trainer's (teacher.mode self)
    samples, _ = split_samples(cfg, cfg.prompts_per_step, split="train", multimodal=False)
    examples, _ = rollout_examples(sample_rollout(engine, samples, processor, cfg, 1), processor, cfg)
    scoring = Scoring.from_config(cfg, processor)
    micro = micro_batches(examples, scoring.micro_batch_size, Ranks(), None)

    def trainer(k):
        values = []
        with torch.no_grad():
            for batch in micro:
                logits = completion_logits(student, scoring.batch(student, [e.teacher for e in batch], [e.completion_ids for e in batch]))
                values += [torch.log_softmax(rows.float(), -1).topk(k, -1).values for rows in logits.split(256)]
        return torch.cat(values)

    def from_engine(k):
        requests = [{"prompt_token_ids": e.teacher.input_ids + e.completion_ids} for e in examples]
        params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
        outputs = engine.llm.generate(requests, params, use_tqdm=False)
        rows = []
        for e, out in zip(examples, outputs):
            start = len(e.teacher.input_ids)
            for position in out.prompt_logprobs[start : start + len(e.completion_ids)]:
                rows.append(sorted((lp.logprob for lp in position.values() if lp.rank <= k), reverse=True))
        return torch.tensor(rows)

    result = {"tokens": sum(len(e.completion_ids) for e in examples), "sequences": len(examples),
              "teacher_prompt_tokens": median([len(e.teacher.input_ids) for e in examples]), "k": {}}
    for k in ks:
        seconds = {"trainer": [], "engine": []}
        for repeat in range(repeats + 1):  # the first is a warm-up
            for name, fn in (("trainer", trainer), ("engine", from_engine))[:: 1 if repeat % 2 == 0 else -1]:
                engine.llm.reset_prefix_cache()
                start = time.perf_counter()
                values = fn(k)
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
                if name == "trainer":
                    ours = values
                else:
                    theirs = values
        result["k"][str(k)] = {
            "trainer_s": median(seconds["trainer"]),
            "engine_s": median(seconds["engine"]),
            "engine_over_trainer": median(seconds["engine"]) / median(seconds["trainer"]),
            "max_abs_diff": (ours - theirs).abs().max().item(),
        }
    engine.close()
    return result


def run_child(name: str, args) -> dict:
    """One setting in a child process; its JSON (the last line of its stdout), with the load average."""
    command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.config:
        command += ["--config", args.config, *args.overrides]
    load_before = os.getloadavg()
    print(f"{name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        return {"name": name, "error": f"exit {done.returncode} (its stderr is above)"}
    result = {"name": name, **json.loads(done.stdout.strip().splitlines()[-1]),
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)  # each setting's result as it comes
    return result


def child(name: str, args) -> dict:
    sys.path.insert(0, str(ROOT))
    from opsd.config import load_config
    from opsd.trainer.console import third_party_output

    config, overrides = (args.config, args.overrides) if args.config else SETTINGS.get(name, (SMOLLM2, ["teacher.mode=self"]))
    with tempfile.TemporaryDirectory(prefix="opsd-step-profile-") as tmp:
        cfg = load_config(ROOT / config, [*overrides, f"logging.output_dir={tmp}", "logging.progress_bar=false",
                                                "eval.every=0", "eval.retention=null"])  # steps only: no evaluation
        with third_party_output(cfg.logging.output_dir, verbose=cfg.logging.verbose) as log_file:
            if name == ENGINE_LOGPROBS:
                return {"config": config, "overrides": overrides, **engine_teacher_logprobs(cfg, log_file, args.steps)}
            return {"config": config, "overrides": overrides, "model": cfg.model.path, "dtype": cfg.model.dtype,
                    "samples_per_prompt": cfg.rollout.samples_per_prompt, "prompts": cfg.prompts_per_step,
                    **profile_setting(cfg, log_file, args.steps, args.warmup)}


def acceptance(settings: list[dict], rollout_ratio: float) -> dict:
    out = {}
    for s in settings:
        if "stage_over_floor" not in s:
            continue
        target = next(v for k, v in TARGETS.items() if s["name"].startswith(k)) if s["name"] in SETTINGS else None
        if target:
            out[f"{s['name']}_stage_within_{target}x_floor"] = s["stage_over_floor"] <= target
        out[f"{s['name']}_parts_within_{PARTS_TOLERANCE:.0%}"] = abs(1 - s["parts_sum_over_time_train"]) <= PARTS_TOLERANCE
    if not math.isnan(rollout_ratio):  # nan: no setting ran a vLLM engine
        out["rollout_at_least_0.9x_direct_vllm_speed"] = 1 / rollout_ratio >= 0.9
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="*", choices=[*SETTINGS, ENGINE_LOGPROBS], default=[*SETTINGS, ENGINE_LOGPROBS])
    parser.add_argument("--config", help="profile this config alone (with the overrides) instead of the settings")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per setting (engine logprobs: repeats)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of --config")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    load_start, started = os.getloadavg(), time.perf_counter()
    names = ["config"] if args.config else args.settings
    results = [run_child(name, args) for name in names]
    settings = [r for r in results if r["name"] != ENGINE_LOGPROBS]
    ratios = [s["rollout_over_direct_vllm"] for s in settings if "rollout_over_direct_vllm" in s]
    rollout_ratio = median(ratios)
    report = {
        "command": " ".join(["bench/step_profile.py", *(argv if argv is not None else sys.argv[1:])]),
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg(),
                    "wall_s": time.perf_counter() - started},
        "settings": settings,
        # opsd's rollout seconds over vLLM's own generate of the same requests (< 1.11: >= 0.9x its speed)
        "rollout_over_direct_vllm": rollout_ratio,
        "engine_teacher_logprobs": next((r for r in results if r["name"] == ENGINE_LOGPROBS), None),
        "acceptance": acceptance(settings, rollout_ratio),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
