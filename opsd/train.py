"""On-policy self-distillation, in one process or on every rank of a torchrun launch.

    python -m opsd.train --config configs/demo.yaml [dotted.key=value ...] [--dry-run]
    torchrun --nproc_per_node 8 -m opsd.train --config ...   # FSDP2, one colocated engine per rank

Each optimizer step: sample completions from the student with the rollout engine -> build the
student and teacher sequences around the same completion ids -> score both -> loss -> backward and
optimizer step -> teacher update -> push the new weights into the engine. Metrics go to
`<output_dir>/metrics.jsonl` (one object per step), the console and, when enabled, wandb.
Checkpoints go to `<output_dir>/checkpoint-{step}`; `checkpoint.resume_from=auto` continues a run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from opsd.config import Config, ConfigError, config_to_dict, load_config
from opsd.data.dataset import describe_data, train_stream
from opsd.data.errors import BadSampleError
from opsd.data.validation import prompt_length_check
from opsd.eval import Evaluator
from opsd.modeling import empty_model, enable_activation_checkpointing, load_model, load_processor, prepare_model_dir
from opsd.prompts import is_multimodal, placeholder_token_ids, student_prompt, teacher_prompt
from opsd.rollout import SamplingSettings, make_engine
from opsd.rollout.dumps import ROLLOUTS_SUBDIR, recorder_for_step
from opsd.rollout.weight_sync import push_weights
from opsd.sequences import build_sample_examples, encode_prompt, padding_example
from opsd.teacher import make_teacher, update_teacher
from opsd.trainer.checkpoint import CheckpointError, TrainingParts
from opsd.trainer.checkpoint_manager import CheckpointManager
from opsd.trainer.device import seed_everything
from opsd.trainer.distributed import Ranks, init_distributed
from opsd.trainer.fsdp import copy_of_shards, load_sharded
from opsd.trainer.memory_plan import detected_device_gb, plan_memory, world_size_from_env
from opsd.trainer.metrics import MetricsLogger, NullMetricsLogger
from opsd.trainer.optim import build_optimizer, build_scheduler
from opsd.trainer.step import train_step


def sampling_settings(cfg: Config, step: int, processor, first_prompt: int = 0) -> SamplingSettings:
    """Prompt i of the call samples with seed `seed + i`; `first_prompt` (the index of the call's first
    prompt in the step's global batch) makes a prompt's seed the same whichever rank samples it."""
    r = cfg.rollout
    return SamplingSettings(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        n=r.samples_per_prompt, seed=cfg.train.seed * 1_000_003 + step * 10_007 + first_prompt,
        banned_token_ids=placeholder_token_ids(processor),
    )


def train(cfg: Config) -> Path:
    output_dir = Path(cfg.logging.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    ranks = init_distributed(cfg.distributed, cfg.train.device)  # before the engine: vLLM joins this group
    device = ranks.device
    checkpoints = CheckpointManager(cfg, output_dir)  # removes half-written saves, finds what to resume

    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    pad_id = getattr(processor, "tokenizer", processor).pad_token_id
    # Datasets are opened (and checked against the config) before any weights are loaded.
    check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    stream = train_stream(cfg, check=check, multimodal=is_multimodal(processor))
    evaluator = Evaluator(cfg, processor, check=check, multimodal=is_multimodal(processor)) if cfg.eval.every else None
    engine = make_engine(cfg, model_dir, processor)
    seed_everything(cfg.train.seed)  # after the engine: an in-process vLLM reseeds the global RNG
    student, teacher = load_student_and_teacher(cfg, processor, ranks)
    optimizer = build_optimizer(cfg.optim, student)
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps)
    logger = (
        MetricsLogger(cfg.logging, output_dir, config_to_dict(cfg),
                      resume_step=checkpoints.resume_step, wandb_run_id=checkpoints.saved_wandb_run_id)
        if ranks.is_main else NullMetricsLogger()
    )
    parts = TrainingParts(student, teacher, cfg.teacher.mode, optimizer, scheduler, processor, stream)
    start_step = checkpoints.start(parts, wandb_run_id=logger.wandb_run_id)  # weights, optimizer, data position
    # Start on-policy: the engine was built from model.path (or is a long-lived server holding other
    # weights), while the student may come from a checkpoint.
    push_weights(student, engine, bucket_mb=cfg.rollout.sync_bucket_mb)
    checkpoints.restore_rng()  # last, so that nothing above shifts the random streams
    prompts_per_step = cfg.train.prompts_per_micro_step * cfg.train.grad_accum_steps

    steps = range(start_step + 1, cfg.train.max_steps + 1)
    progress = cfg.logging.progress_bar and ranks.is_main
    for step in tqdm(steps, initial=start_step, total=cfg.train.max_steps, disable=not progress, desc="opsd"):
        # 1. Sample completions from the current student weights (each rank its own prompts).
        t0 = time.perf_counter()
        samples = stream.take(prompts_per_step, rank=ranks.rank, world_size=ranks.world_size)
        student_prompts = [student_prompt(s, processor, cfg.prompts) for s in samples]
        sampling = sampling_settings(cfg, step, processor, first_prompt=ranks.rank * prompts_per_step)
        completions = engine.generate(student_prompts, sampling)

        # 2. Student and teacher sequences end with the identical completion ids.
        t1 = time.perf_counter()
        examples, counts = build_sample_examples(
            processor, cfg.prompts, samples, student_prompts, completions, cfg.train.max_forward_tokens
        )
        # Global token normalisation: the step's loss is divided by the completion tokens of all ranks.
        *dropped, step_tokens = map(int, ranks.sum([*counts.values(), sum(len(e.completion_ids) for e in examples)]))
        counts = dict(zip(counts, dropped))
        if step_tokens == 0:  # no rank has anything to train on: all ranks skip together
            record = {
                "skipped_step": 1, **counts, "lr": scheduler.get_last_lr()[0],
                **stream.metrics(), **(evaluator.run_if_due(step, engine, ranks) if evaluator else {}),
            }
            logger.log(step, record)
            checkpoints.step_end(step, record)
            continue

        # 3. Score with both roles, loss over the whole step's tokens, backward, optimizer step. A
        #    colocated engine gives its memory to training until the weight sync below.
        if hasattr(engine, "release_memory"):
            engine.release_memory()
        lr = scheduler.get_last_lr()[0]
        recorder = recorder_for_step(cfg, step)  # None unless this step's rollouts are dumped
        metrics = train_step(
            student, teacher, examples, optimizer,
            loss_cfg=cfg.loss,
            micro_batch_size=cfg.train.prompts_per_micro_step * cfg.rollout.samples_per_prompt,
            max_grad_norm=cfg.optim.max_grad_norm,
            dtype=cfg.model.dtype,
            pad_id=pad_id,
            on_scored=recorder.collect if recorder else None,
            ranks=ranks,
            total_tokens=step_tokens,
            padding=rank_padding(cfg, processor, samples[0], pad_id) if ranks.enabled else None,
        )
        scheduler.step()
        update_teacher(cfg.teacher, teacher, student)

        # 4. Push the new weights into the engine so the next rollouts are on-policy. Every rank takes
        #    part in gathering each full tensor from the shards and pushes it into its own engine.
        t2 = time.perf_counter()
        sync = push_weights(student, engine, bucket_mb=cfg.rollout.sync_bucket_mb)

        if recorder:
            recorder.write(output_dir / ROLLOUTS_SUBDIR, step, examples, samples, processor, cfg.prompts)
        record = {
            **metrics, **counts, "lr": lr,
            "time_rollout_s": t1 - t0, "time_train_s": t2 - t1, "time_weight_sync_s": sync.seconds,
            "weight_sync_bytes": sync.bytes, "weight_sync_gathered_bytes": sync.gathered_bytes,
            **stream.metrics(), **(evaluator.run_if_due(step, engine, ranks) if evaluator else {}),
        }
        logger.log(step, record)
        checkpoints.step_end(step, record)  # saves every checkpoint.save_every steps and at the end

    logger.close()
    ranks.barrier()
    engine.close()
    ranks.close()
    return output_dir


def load_student_and_teacher(cfg: Config, processor, ranks: Ranks):
    """The student and the teacher scoring model (`self`: the student itself).

    Under torchrun both are FSDP2-sharded from empty models: rank 0 alone reads the weight files,
    every rank receives its shards, and an EMA / fixed teacher copies the student's shards.
    """
    student = empty_model(cfg.model, processor) if ranks.enabled else load_model(cfg.model, processor, ranks.device)
    if cfg.distributed.activation_checkpointing:
        enable_activation_checkpointing(student)
    if not ranks.enabled:
        return student, make_teacher(cfg.teacher, student)
    read = lambda: load_model(cfg.model, processor, torch.device("cpu")).state_dict()  # noqa: E731
    student = load_sharded(student, read, ranks, cfg.distributed, trainable=True)
    if cfg.teacher.mode == "self":
        return student, student
    return student, copy_of_shards(empty_model(cfg.model, processor), student, ranks, cfg.distributed)


def rank_padding(cfg: Config, processor, sample, pad_id: int):
    """The example a rank trains on at loss weight 0 when it has fewer micro-batches than another."""
    student = encode_prompt(processor, student_prompt(sample, processor, cfg.prompts))
    teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg.prompts))
    return padding_example(student, teacher, pad_id)


def describe_plan(cfg: Config) -> str:
    t, r = cfg.train, cfg.rollout
    prompts = t.prompts_per_micro_step * t.grad_accum_steps
    return "\n".join([
        f"plan: {t.max_steps} optimizer steps x {prompts} prompts x {r.samples_per_prompt} samples "
        f"({t.grad_accum_steps} micro-steps of {t.prompts_per_micro_step * r.samples_per_prompt} sequences)",
        f"  model {cfg.model.path} ({cfg.model.dtype}{', built if missing: ' + cfg.model.build if cfg.model.build else ''})",
        f"  rollout engine {r.engine}: up to {r.max_new_tokens} new tokens, T={r.temperature}, top_p={r.top_p}, top_k={r.top_k}",
        f"  teacher {cfg.teacher.mode}; privileged {'+'.join(cfg.prompts.privileged)}"
        f"{' (noise ablation)' if cfg.prompts.noise_privileged_images else ''}",
        f"  loss {cfg.loss.kind}: jsd x{cfg.loss.jsd_weight} + ce x{cfg.loss.ce_weight}, beta={cfg.loss.beta}, "
        f"T={cfg.loss.temperature}, top_k={cfg.loss.top_k}, clip={cfg.loss.token_clip} ({cfg.loss.clip_mode})",
        f"  optim AdamW lr={cfg.optim.lr} ({cfg.optim.schedule}, warm-up {cfg.optim.warmup_steps}, min {cfg.optim.min_lr})",
        f"  data {describe_data(cfg.data)}; bad samples: {cfg.data.on_bad_sample}",
        f"  eval {f'every {cfg.eval.every} steps on {cfg.eval.num_samples} samples' if cfg.eval.every else 'off'}"
        f"{' (student and teacher prompts)' if cfg.eval.every and cfg.eval.with_teacher_prompt else ''}",
        f"  output {cfg.logging.output_dir} (wandb {cfg.logging.wandb.mode})",
        f"  checkpoints every {cfg.checkpoint.save_every or t.max_steps} steps"
        f"{f', keep {cfg.checkpoint.save_total_limit}' if cfg.checkpoint.save_total_limit else ''}"
        f"{f', resume from {cfg.checkpoint.resume_from}' if cfg.checkpoint.resume_from else ''}",
        f"  under torchrun: these prompts per rank; FSDP2 params {cfg.distributed.param_dtype}, "
        f"shards of {cfg.distributed.shard_size or 'all'} ranks, {r.tensor_parallel_size} rank(s) per vLLM engine",
    ])


def describe_memory(cfg: Config, world_size: int, device_gb: float | None) -> str:
    try:
        return plan_memory(cfg, world_size, device_gb).describe()
    except FileNotFoundError as err:
        if cfg.model.build:
            return f"memory plan: skipped, {cfg.model.path} is built at the first run (model.build: {cfg.model.build})"
        return f"memory plan: skipped, {err}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opsd.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config, plan and memory plan, exit")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: ranks to plan memory for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="--dry-run: memory of one device in GB (default: the detected CUDA device)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=5")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        print(describe_plan(cfg))
        print(describe_memory(cfg, args.world_size or world_size_from_env(), args.gpu_memory_gb or detected_device_gb()))
        return 0
    try:
        train(cfg)
    except (CheckpointError, ConfigError, BadSampleError) as err:  # bad checkpoint, data not fitting the config, a bad row
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
