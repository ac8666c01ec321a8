"""On-policy self-distillation, in one process or on every rank of a torchrun launch.

    python -m opsd.train --config configs/smoke.yaml [dotted.key=value ...] [--dry-run]
    torchrun --nproc_per_node 8 -m opsd.train --config ...   # FSDP2, one colocated engine per rank

Each optimizer step: sample completions from the student with the rollout engine -> build the
student and teacher sequences around the same completion ids -> score both -> loss -> backward and
optimizer step -> teacher update -> push the new weights into the engine. Metrics go to
`<output_dir>/metrics.jsonl` (one object per step), the console and, when enabled, wandb.
Checkpoints go to `<output_dir>/checkpoint-{step}`; `checkpoint.resume_from=auto` continues a run.
SIGTERM, SIGINT or SIGUSR1 stop it after the step in progress with a checkpoint (docs/faults.md).
"""

from __future__ import annotations

import argparse
import atexit
import sys
import time
import warnings
from contextlib import ExitStack, closing, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opsd.config import CheckpointConfig, Config, ConfigError, config_to_dict, load_config


# The command line comes first: as a script, a config mistake is named before torch, transformers
# and vLLM are imported below (about a second instead of 8 to 47 s on a loaded machine).
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opsd.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config, plan and memory plan, exit")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: ranks to plan memory for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="--dry-run: memory of one device in GB (default: the detected CUDA device)")
    parser.add_argument("--check", action="store_true",
                        help="self-test on one step's prompts (divergence 0 without privileged information, "
                             "engine/trainer logprobs agree, weight sync), print the divergence with it, exit")
    parser.add_argument("--verbose", action="store_true",
                        help="also show third-party output (vLLM, transformers, warnings) on the console; "
                             "it always goes to <output_dir>/run.log (sets logging.verbose)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=5")
    return parser.parse_args(argv)


def load_args_config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides + (["logging.verbose=true"] if args.verbose else []))


if __name__ == "__main__":
    try:
        load_args_config(parse_args())
    except ConfigError as _err:
        print(f"error: {_err}", file=sys.stderr)
        sys.exit(2)
    _FINAL_LINES: list[Callable[[], str]] = []
    # Registered before the heavy imports register theirs: atexit runs it last, so a line written
    # here measures the whole shutdown of the process (its threads, vLLM's and torch's exit handlers).
    atexit.register(lambda: [print(line(), file=sys.stderr, flush=True) for line in _FINAL_LINES])

import torch  # noqa: E402 (the imports below come after the command-line check above)
import yaml
from tqdm.auto import tqdm

from opsd.data.dataset import describe_data, peek_data, train_stream
from opsd.data.errors import BadSample, BadSampleError
from opsd.data.sample import Sample
from opsd.data.stream import SampleStream
from opsd.device import DeviceError, process_rank, process_world_size
from opsd.dumps.record import ROLLOUTS_SUBDIR, RolloutRecorder, recorder_for_step
from opsd.evaluation import Evaluator
from opsd.lora import add_lora
from opsd.loss_kinds import build_loss
from opsd.modeling import (
    empty_model, enable_activation_checkpointing, load_frozen_model, load_model, load_processor, prepare_model_dir,
    teacher_model_config, vision_parameter_names,
)
from opsd.pipeline import Rollout, rollout_examples, sample_rollout
from opsd.prompts import describe_prompts, is_multimodal, student_prompt, teacher_prompt
from opsd.rewards import RewardError, Rewards, reward_metrics
from opsd.rollout import EngineLost, RolloutEngine, make_engine
from opsd.rollout.weight_sync import check_adapter_receiver, sync_student
from opsd.scoring import Scoring, Timed, UnsupportedModelError, check_scoring_matches_forward, untimed
from opsd.sequences import Example, encode_prompt, padding_example, prompt_length_check
from opsd.teacher import Teacher, TeacherLoader, check_teacher, frozen_copy, make_teacher, teacher_class, teacher_loader
from opsd.trainer.checkpoint import CheckpointError, TrainingParts, latest_checkpoint
from opsd.trainer.checkpoint_manager import CheckpointManager
from opsd.trainer.console import native_output_to_log, third_party_output
from opsd.trainer.distributed import Ranks, init_distributed
from opsd.trainer.fsdp import copy_of_shards, load_sharded, shard_model
from opsd.trainer.heartbeat import EXIT_RANK_LOST
from opsd.trainer.host_memory import keep_freed_memory
from opsd.trainer.memory_plan import detected_device_gb, plan_memory
from opsd.trainer.output_lock import OutputDirInUse, output_dir_lock
from opsd.trainer.metrics import MetricsLogger, NullMetricsLogger, StageTimer, mismatch_threshold
from opsd.trainer.optim import build_optimizer, build_scheduler, warmup_warning
from opsd.trainer.rng import seed_everything
from opsd.trainer.step import NonFiniteStepsError, TrainStep
from opsd.trainer.stop import EXIT_STOPPED, RunStopped, StepStart, StopRequest, signal_name, stop_on_signals
from opsd.trainer.summary import format_summary, read_records, run_summary, write_summary


class EngineLostError(RuntimeError):
    """The rollout engine stopped answering; the last finished step is saved (status 4)."""


def train(cfg: Config) -> Path:
    """Train to `train.max_steps`; raises `RunStopped` after a clean stop on a signal."""
    # One run per output directory, taken before anything in it is touched (rank 0 holds it for the job).
    lock = output_dir_lock(cfg.logging.output_dir) if process_rank() == 0 else nullcontext()
    with lock, third_party_output(cfg.logging.output_dir, verbose=cfg.logging.verbose) as log_file, \
            stop_on_signals(announce=process_rank() == 0) as stop:
        run = start_run(cfg, log_file)
        try:
            stopped = train_steps(run, stop)
        except BaseException:
            abort_run(run)
            raise
        end_run(run, stopped)
    if stopped is not None:
        raise stopped
    return run.output_dir


def train_steps(run: Run, stop: StopRequest) -> RunStopped | None:
    """The steps from the start (or resumed) step to `train.max_steps`, or to a stop signal."""
    cfg = run.cfg
    baseline_evaluation(run)
    progress = cfg.logging.progress_bar and run.ranks.is_main
    steps = range(run.start_step + 1, cfg.train.max_steps + 1)
    for step in tqdm(steps, initial=run.start_step, total=cfg.train.max_steps, disable=not progress, desc="opsd"):
        if signum := stop.agreed(run.ranks):  # a signal came during the last step: all ranks stop here
            return stop_run(run, signum, stop)
        before_rollout = StepStart.capture(run.stream)  # an abandoned step must leave no trace
        timer, lr = StageTimer(), run.scheduler.get_last_lr()[0]
        try:
            with timer("rollout"):
                rollout = sample(run, step)
        except EngineLost as lost:  # the step is abandoned as at a stop signal; the last finished one is saved
            before_rollout.restore(run.stream)
            raise engine_lost(run, lost, step, run.last_step, run.last_record) from lost
        if signum := stop.agreed(run.ranks):  # it came during the rollout: the step is abandoned
            before_rollout.restore(run.stream)
            return stop_run(run, signum, stop)
        trained = training_stage(run, rollout, step, timer)
        if trained.metrics is None:  # no rank has anything to train on: all ranks skipped the update together
            finish_step(run, step, {"skipped_step": 1, **trained.counts, "lr": lr, **timer.record()})
            continue
        if trained.metrics.get("nonfinite_step"):  # not applied: the engine keeps the last good weights
            finish_step(run, step, {**trained.metrics, **trained.counts, "lr": lr, **timer.record()})
            check_bad_steps(run, step)
            continue
        run.bad_steps = 0
        try:
            with timer("weight_sync"):  # the next rollouts are on-policy; a frozen vision tower stays as synced
                sync = sync_student(run.student, run.engine, bucket_mb=cfg.rollout.sync_bucket_mb,
                                    lora_sync=cfg.rollout.lora_sync, exclude=run.frozen)
        except EngineLost as lost:  # the update is applied: the step is logged and saved (a resume syncs the engine)
            record = {**trained.metrics, **trained.counts, "lr": lr, **timer.record()}
            run.logger.log(step, record)
            run.checkpoints.step_end(step, record)
            raise engine_lost(run, lost, step, step, record) from lost
        record = {**trained.metrics, **trained.counts, "lr": lr, **timer.record(),
                  "weight_sync_bytes": sync.bytes, "weight_sync_gathered_bytes": sync.gathered_bytes}
        recorder = trained.recorder
        finish_step(run, step, record, rollouts=(recorder, trained.examples, rollout.samples) if recorder else None)
    return None


@dataclass
class Trained:
    """What the training stage of one step leaves: its metrics (None: the step was skipped), the
    counts of what was cut or dropped, the examples and the rollout recorder of the step."""

    metrics: dict | None
    counts: dict
    examples: list[Example]
    recorder: RolloutRecorder | None = None


def training_stage(run: "Run", rollout: Rollout, step: int, timer: StageTimer) -> Trained:
    """Sequences, scoring, loss, backward, optimizer step and teacher update of one step, timed by
    `timer` as the `train` stage with its parts (`time_train/<part>_s`); the LR schedule and the
    teacher move on a skipped step too. bench/step_profile.py measures this same function."""
    with timer("train"), timer.part("sequences"):
        examples, counts, step_tokens = build_sequences(run, rollout)
    if step_tokens == 0:
        advance_schedules(run)
        return Trained(None, counts, examples)
    recorder = recorder_for_step(run.cfg, step)  # None unless this step's rollouts are dumped
    if run.engine.capabilities.release_memory:  # a colocated engine gives training its memory until the sync
        run.engine.release_memory()
    with timer("train"):
        metrics = update_student(run, examples, step_tokens, recorder, rollout.samples[0], timer.part)
        advance_schedules(run, timer.part, teacher=not metrics.get("nonfinite_step"))
    return Trained(metrics, counts, examples, recorder)


@dataclass
class Run:
    """What a run holds while it trains; built by `start_run`."""

    cfg: Config
    output_dir: Path
    ranks: Ranks
    processor: Any
    stream: SampleStream
    evaluator: Evaluator | None
    engine: RolloutEngine
    student: torch.nn.Module
    teacher: Teacher
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: TrainStep
    """One optimizer step over a step's examples (scoring, loss, backward, clip, optimizer step)."""
    logger: MetricsLogger | NullMetricsLogger
    checkpoints: CheckpointManager
    frozen: frozenset[str] = frozenset()
    """Weights that never change (`model.freeze_vision`): after the first sync, not sent again to an
    engine that keeps its weights (`sync_student`; one that discards them while released gets them all)."""
    start_step: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_step: int = 0
    """The last step finished (logged, saved when due)."""
    last_record: dict = field(default_factory=dict)
    bad_steps: int = 0
    """Steps in a row not applied for a non-finite loss or gradient norm (`train.max_bad_steps`)."""
    rewards: Rewards | None = None
    """The reward functions (`reward` section); None = no rewards."""


def start_run(cfg: Config, log_file: Path) -> Run:
    """Process group, data, engine, models, optimizer, logger; resumed from a checkpoint when asked.
    What the engine prints while it starts goes to `log_file` unless `logging.verbose`."""
    output_dir = Path(cfg.logging.output_dir)
    ranks = init_distributed(cfg.distributed, cfg.train.device)  # before the engine: vLLM joins this group
    if ranks.device.type == "cpu" and cfg.train.keep_freed_memory:
        keep_freed_memory()  # before the engine and the models load: steps reuse what they free
    if ranks.is_main:
        print(describe_plan(cfg), flush=True)
    checkpoints = CheckpointManager(cfg, output_dir)  # removes half-written saves, finds what to resume
    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    check_teacher(cfg.teacher, cfg.model, processor)  # a model teacher's tokenizer, in seconds, before any weights
    # Datasets are opened (and checked against the config) before any weights are loaded.
    check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    stream = train_stream(cfg, check=check, multimodal=is_multimodal(processor), sharded=ranks.enabled)
    if ranks.is_main:
        print(describe_first_sample(first_row(stream), cfg), flush=True)
    evaluator = Evaluator(cfg, processor, check=check, multimodal=is_multimodal(processor)) if cfg.eval.every else None
    rewards = Rewards.from_config(cfg.reward, cfg.eval.answer_pattern) if cfg.reward else None  # imports resolved here
    with native_output_to_log(None if cfg.logging.verbose else log_file):
        engine = make_engine(cfg, model_dir, processor)
    with ExitStack() as on_error:  # a failure below closes the engine (and the metrics file)
        on_error.callback(ranks.stop_heartbeat)
        on_error.callback(close_quietly, engine)
        seed_everything(cfg.train.seed)  # after the engine: an in-process vLLM reseeds the global RNG
        student, teacher = load_student_and_teacher(cfg, processor, ranks)
        optimizer = build_optimizer(cfg.optim, student)
        scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps)
        logger = on_error.enter_context(closing(
            MetricsLogger(cfg.logging, output_dir, config_to_dict(cfg), resume_step=checkpoints.resume_step,
                          wandb_run_id=checkpoints.saved_wandb_run_id, mismatch_threshold=mismatch_threshold(cfg))
            if ranks.is_main else NullMetricsLogger()
        ))
        parts = TrainingParts(student, teacher, optimizer, scheduler, processor, stream)
        start_step = checkpoints.start(parts, wandb_run_id=logger.wandb_run_id)  # weights, optimizer, data position
        # Start on-policy: the engine was built from model.path (or is a long-lived server holding other
        # weights), while the student may come from a checkpoint.
        if cfg.model.lora and cfg.rollout.lora_sync == "adapter":
            check_adapter_receiver(engine)
        sync_student(student, engine, bucket_mb=cfg.rollout.sync_bucket_mb, lora_sync=cfg.rollout.lora_sync)
        checkpoints.restore_rng()  # last, so that nothing above shifts the random streams
        frozen = frozenset(vision_parameter_names(student)) if cfg.model.freeze_vision else frozenset()
        step = TrainStep(student, teacher.scorer, optimizer, Scoring.from_config(cfg, processor), cfg.optim.max_grad_norm, ranks)
        on_error.pop_all()
    return Run(cfg, output_dir, ranks, processor, stream, evaluator, engine, student, teacher,
               optimizer, scheduler, step, logger, checkpoints, frozen, start_step, last_step=start_step, rewards=rewards)


def sample(run: Run, step: int) -> Rollout:
    """This rank's prompts of the step, and completions sampled from the current student weights
    (a loss kind that does not sample, `sft`: each sample's privileged text instead, n times)."""
    per_rank = run.cfg.prompts_per_step
    samples = run.stream.take(per_rank, rank=run.ranks.rank, world_size=run.ranks.world_size)
    return sample_rollout(run.engine, samples, run.processor, run.cfg, step, first_prompt=run.ranks.rank * per_rank,
                          on_policy=run.step.scoring.loss.on_policy)


def build_sequences(run: Run, rollout: Rollout) -> tuple[list[Example], dict[str, int], int]:
    """Each completion's reward and advantage (with a `reward` section), student and teacher sequences
    ending with the identical completion ids; what was dropped or cut and the reward metrics (summed
    over ranks); the completion tokens of all ranks."""
    rewards = run.rewards.score(rollout.samples, rollout.completions) if run.rewards else None
    examples, counts = rollout_examples(rollout, run.processor, run.cfg, advantages=rewards.advantages if rewards else None)
    completions = rollout.completions
    capped = sum(c.hit_token_limit(run.cfg.rollout.max_new_tokens) for c in completions)
    reward_sums = rewards.sums() if rewards else []
    # Global token normalisation: the step's loss is divided by the completion tokens of all ranks.
    *dropped, capped, num_completions, step_tokens = run.ranks.sum(
        [*counts.values(), *reward_sums, capped, len(completions), sum(len(e.completion_ids) for e in examples)]
    )
    dropped, reward_sums = dropped[: len(counts)], dropped[len(counts):]
    capped, num_completions, step_tokens = int(capped), int(num_completions), int(step_tokens)
    counts = dict(zip(counts, map(int, dropped)))
    counts["truncated_fraction"] = capped / num_completions if num_completions else 0.0  # hit max_new_tokens
    if rewards:
        counts.update(reward_metrics(run.rewards.names, reward_sums))
    return examples, counts, step_tokens


def update_student(run: Run, examples: list[Example], step_tokens: int, recorder: RolloutRecorder | None, sample,
                   timed: Timed = untimed) -> dict:
    """Score with both roles, loss over the whole step's tokens, backward, optimizer step."""
    padding = rank_padding(run.cfg, run.processor, sample, run.step.scoring.pad_id) if run.ranks.enabled else None
    return run.step(examples, step_tokens, padding, recorder.collect if recorder else None, timed)


def advance_schedules(run: Run, timed: Timed = untimed, *, teacher: bool = True) -> None:
    """The LR schedule and the EMA teacher move one step on every step, the skipped ones included
    (an EMA toward unchanged weights), so that both stay functions of the step count. A step that
    was not applied (a non-finite loss, `teacher=False`) moves the schedule only."""
    with timed("lr_schedule"), warnings.catch_warnings():  # a first step skipped calls the schedule before any optimizer step
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        run.scheduler.step()
    if teacher:
        with timed("teacher_update"):
            run.teacher.update(run.student)


def check_bad_steps(run: Run, step: int) -> None:
    """After a step that was not applied: say so; `train.max_bad_steps` of them in a row stop the run
    with a checkpoint of the last good weights (the bad steps changed nothing)."""
    run.bad_steps += 1
    limit, record = run.cfg.train.max_bad_steps, run.last_record
    values = f"loss {record.get('loss')}, grad_norm {record.get('grad_norm')}"
    if run.ranks.is_main:
        tqdm.write(f"WARNING: step {step}: {values}: not finite, the update was not applied "
                   f"({run.bad_steps} in a row; train.max_bad_steps={limit} stops the run)")
    if run.bad_steps < limit:
        return
    checkpoints = run.checkpoints
    if checkpoints.last_saved_step != step:
        checkpoints.save(step, record)
    first = step - run.bad_steps + 1
    raise NonFiniteStepsError(
        f"steps {first}-{step} had a non-finite loss or gradient norm ({values}) and were not applied: "
        f"train.max_bad_steps={limit} in a row stops the run. checkpoint-{step} holds the weights after step "
        f"{first - 1}; lower optim.lr (now {run.cfg.optim.lr:g}) or check the data, then continue with "
        "checkpoint.resume_from=auto"
    )


def baseline_evaluation(run: Run) -> None:
    """With evaluation on, a fresh run is evaluated before its first step, logged as step 0."""
    if run.evaluator is not None and run.start_step == 0:
        run.logger.log(0, run.evaluator.run_if_due(0, run.engine, run.ranks, run.student))


def finish_step(run: Run, step: int, record: dict, rollouts: tuple | None = None) -> None:
    """The end of every step, trained or skipped: rollout dumps, evaluation when due, log, checkpoint."""
    if rollouts:
        recorder, examples, samples = rollouts
        recorder.write(run.output_dir / ROLLOUTS_SUBDIR, step, examples, samples, run.processor, run.cfg.prompts)
    evaluation = run.evaluator.run_if_due(step, run.engine, run.ranks, run.student) if run.evaluator else {}
    record = {**record, **run.stream.metrics(), **evaluation}
    run.logger.log(step, record)
    run.checkpoints.step_end(step, record)  # saves every checkpoint.save_every steps and at the end (save_final)
    run.last_step, run.last_record = step, record


def stop_run(run: Run, signum: int, stop: StopRequest) -> RunStopped:
    """After a stop signal: save the last finished step unless it was just saved (or nothing ran)."""
    step, checkpoints = run.last_step, run.checkpoints
    if run.cfg.checkpoint.save_on_signal and step > 0 and checkpoints.last_saved_step != step:
        checkpoints.save(step, run.last_record)
    latest = latest_checkpoint(run.output_dir)
    return RunStopped(signal_name(signum), step, latest.path.name if latest else None, stop.at)


def engine_lost(run: Run, lost: EngineLost, step: int, finished: int, record: dict) -> EngineLostError:
    """The engine stopped answering during `step`: save `finished` (the last step whose update is in
    the weights) unless it was just saved, and say how to continue."""
    checkpoints = run.checkpoints
    # Under torchrun the other ranks are not at this point: a save (collective) would hang; torchrun ends the job.
    if finished > 0 and checkpoints.last_saved_step != finished and not run.ranks.enabled:
        checkpoints.save(finished, record)
    latest = latest_checkpoint(run.output_dir)
    saved = (f"{latest.path.name} holds step {latest.step}" if latest else "no checkpoint yet (no step finished)")
    return EngineLostError(
        f"{lost} (during step {step}); {saved}. Restart the engine (the rollout server), then continue with "
        f"checkpoint.resume_from=auto (exit status {EXIT_RANK_LOST})"
    )


def end_run(run: Run, stopped: RunStopped | None = None) -> None:
    run.logger.close()
    if run.ranks.is_main:  # the summary, on the console and in summary.json
        summary = run_summary(read_records(run.logger.path), output_dir=run.output_dir,
                              wall_time_s=time.perf_counter() - run.started, start_step=run.start_step,
                              stopped=stopped.describe() if stopped else None,
                              mismatch_threshold=mismatch_threshold(run.cfg), see_also=run.cfg.logging.see_also)
        write_summary(run.output_dir, summary)
        tqdm.write(format_summary(summary))
    run.ranks.barrier()
    run.engine.close()
    run.ranks.close()


def abort_run(run: Run) -> None:
    """An error ends the run: close what it opened, without waiting for the other ranks."""
    run.logger.close()
    run.ranks.stop_heartbeat()
    close_quietly(run.engine)


def close_quietly(engine: RolloutEngine) -> None:
    with suppress(Exception):  # on an error path: the error that got us here is the one to report
        engine.close()


def load_student_and_teacher(cfg: Config, processor, ranks: Ranks):
    """The student and the teacher scoring model (`self`: the student itself).

    Under torchrun both are FSDP2-sharded from empty models: rank 0 alone reads the weight files,
    every rank receives its shards, an EMA / fixed teacher copies the student's shards, and a model
    teacher is loaded the same way into FSDP units of its own.
    """
    if cfg.model.lora:
        return load_lora_student_and_teacher(cfg, processor, ranks)
    student = empty_model(cfg.model, processor) if ranks.enabled else load_model(cfg.model, processor, ranks.device)
    if cfg.distributed.activation_checkpointing:
        enable_activation_checkpointing(student)
    if not ranks.enabled:
        check_scoring_matches_forward(student)  # a model whose logits scoring would not reproduce stops here
        return student, make_teacher(cfg.teacher, student, frozen_copy, teacher_loader(cfg.model, processor, ranks.device))
    read = lambda: load_model(cfg.model, processor, torch.device("cpu")).state_dict()  # noqa: E731
    student = load_sharded(student, read, ranks, cfg.distributed, trainable=True)
    check_scoring_matches_forward(student)  # on every rank: the sharded forwards gather collectively
    student.reshard()  # a trainable root keeps its gathered weights until a backward, which this had none of
    copy_shards = lambda s: copy_of_shards(empty_model(cfg.model, processor), s, ranks, cfg.distributed)  # noqa: E731
    return student, make_teacher(cfg.teacher, student, copy_shards, sharded_teacher_loader(cfg, processor, ranks))


def sharded_teacher_loader(cfg: Config, processor, ranks: Ranks) -> TeacherLoader:
    """A model teacher under torchrun, loaded like the student (rank 0 reads, every rank keeps its
    shards) into FSDP units of its own that gather while scoring and free right after."""

    def load(teacher_cfg) -> torch.nn.Module:
        model_cfg = teacher_model_config(cfg.model, teacher_cfg)
        prepare_model_dir(model_cfg)
        read = lambda: load_frozen_model(model_cfg, processor, torch.device("cpu"), teacher_cfg.dtype).state_dict()  # noqa: E731
        teacher = load_sharded(empty_model(model_cfg, processor, teacher_cfg.dtype), read, ranks, cfg.distributed,
                               trainable=False, param_dtype=teacher_cfg.dtype)
        teacher.eval().requires_grad_(False)
        check_scoring_matches_forward(teacher)  # on every rank, as for the student
        return teacher

    return load


def load_lora_student_and_teacher(cfg: Config, processor, ranks: Ranks):
    """A LoRA student (adapter teachers are views of it). Under torchrun every rank reads the full
    weights on the CPU, adds the adapter, then keeps its shards: the rank-0-only loading of full
    training does not know the adapter's parameters yet."""
    if ranks.enabled and cfg.model.lora.base_dtype != "float32":
        # FSDP2 shards a unit's parameters in one dtype: a bfloat16 base beside float32 adapters does not shard.
        raise ConfigError("model.lora.base_dtype=bfloat16 runs in one process (no torchrun) for now: "
                          "FSDP2 cannot shard a bfloat16 base beside float32 adapters")
    student = load_model(cfg.model, processor, torch.device("cpu") if ranks.enabled else ranks.device)
    check_scoring_matches_forward(student)  # a model whose logits scoring would not reproduce stops here
    if cfg.distributed.activation_checkpointing:
        enable_activation_checkpointing(student)
    student = add_lora(student, cfg.model.lora, ema=teacher_class(cfg.teacher, lora_student=True).ADDS_EMA_ADAPTER)
    load_teacher = teacher_loader(cfg.model, processor, torch.device("cpu") if ranks.enabled else ranks.device)
    teacher = make_teacher(cfg.teacher, student, frozen_copy, load_teacher)
    if not ranks.enabled:
        return student, teacher
    student = shard_model(student.to(ranks.device), ranks, cfg.distributed, trainable=True)
    if teacher.module is not None:  # a frozen copy (or a model teacher) of its own, sharded in place
        shard_model(teacher.module.to(ranks.device), ranks, cfg.distributed, trainable=False,
                    param_dtype=cfg.teacher.dtype if teacher_class(cfg.teacher, lora_student=True).LOADS_MODEL else None)
    return student, teacher


def rank_padding(cfg: Config, processor, sample, pad_id: int):
    """The example a rank trains on at loss weight 0 when it has fewer micro-batches than another."""
    student = encode_prompt(processor, student_prompt(sample, processor, cfg.prompts))
    teacher = encode_prompt(processor, teacher_prompt(sample, processor, cfg.prompts))
    return padding_example(student, teacher, pad_id)


def describe_plan(cfg: Config) -> str:
    t, r, loss = cfg.train, cfg.rollout, build_loss(cfg.loss)
    # A kind that neither samples nor asks a teacher (sft) uses the engine for evaluation only.
    sampling = (f"up to {r.max_new_tokens} new tokens, T={r.temperature}, top_p={r.top_p}, top_k={r.top_k}" if loss.on_policy
                else f"no sampling (loss {cfg.loss.kind}); {'greedy evaluation only' if cfg.eval.every else 'unused'}")
    model_teacher = f" {cfg.teacher.path} ({cfg.teacher.dtype})" if cfg.teacher.path else ""
    teacher = f"teacher {cfg.teacher.mode}{model_teacher}" if loss.needs_teacher else f"no teacher (loss {cfg.loss.kind})"
    return "\n".join([
        f"plan: {t.max_steps} optimizer steps x {cfg.prompts_per_step} prompts x {r.samples_per_prompt} samples "
        f"({t.grad_accum_steps} micro-steps of {cfg.micro_batch_size} sequences)",
        f"  model {cfg.model.path} ({cfg.model.dtype}{', built if missing: ' + cfg.model.build if cfg.model.build else ''})",
        f"  rollout engine {r.engine}: {sampling}",
        f"  {describe_lora(cfg)}",
        f"  {teacher}; privileged {'+'.join(cfg.prompts.privileged)}"
        f"{f' ({cfg.prompts.noise} noise ablation)' if cfg.prompts.noise != 'off' else ''}",
        f"  loss {cfg.loss.kind}: {loss.describe()}",
        *([f"  reward: {' + '.join(f'{f.weight:g} x {f.name}' for f in cfg.reward.functions)}"
           f"{'' if cfg.reward.scale_by_std else ' (advantages not divided by the group std)'}"] if cfg.reward else []),
        f"  optim AdamW lr={cfg.optim.lr} ({cfg.optim.schedule}, warm-up {cfg.optim.warmup_steps}, min {cfg.optim.min_lr})"
        + (f"\n  {warning}" if (warning := warmup_warning(cfg.optim, t.max_steps)) else ""),
        f"  data {describe_data(cfg.data)}; bad samples: {cfg.data.on_bad_sample}",
        f"  eval {f'every {cfg.eval.every} steps on {cfg.eval.num_samples} samples' if cfg.eval.every else 'off'}"
        f"{' (student and teacher prompts)' if cfg.eval.every and cfg.eval.with_teacher_prompt else ''}"
        f"{f', answer pattern {cfg.eval.answer_pattern}' if cfg.eval.every else ''}",
        *([f"  shows: {describe_evidence(cfg)}"] if cfg.eval.every else []),
        f"  output {cfg.logging.output_dir} (wandb {cfg.logging.wandb.mode})",
        f"  {describe_saves(cfg.checkpoint, t.max_steps)}",
        f"  under torchrun: these prompts per rank; FSDP2 params {cfg.distributed.param_dtype}, "
        f"shards of {cfg.distributed.shard_size or 'all'} ranks, {r.tensor_parallel_size} rank(s) per vLLM engine",
        *([f"  see also: {cfg.logging.see_also}"] if cfg.logging.see_also else []),
    ])


def describe_saves(c: CheckpointConfig, max_steps: int) -> str:
    """When checkpoints are written, how many are kept, what is resumed (the plan's line)."""
    if c.save_final or c.save_every:
        when = f"checkpoints every {c.save_every or max_steps} steps"
        if not c.save_final:
            when += f", none at the end ({_no_final_save(c)})"
        when += f", keep {c.save_total_limit}" if c.save_total_limit else ""
    else:
        when = f"no checkpoints ({_no_final_save(c)})"
    return when + (f", resume from {c.resume_from}" if c.resume_from else "")


def _no_final_save(c: CheckpointConfig) -> str:
    return f"checkpoint.save_final: false{'; a stop signal saves' if c.save_on_signal else ''}"


def describe_evidence(cfg: Config) -> str:
    """What the run's evaluations will show (the summary prints it at step 0 and at the end)."""
    e, t = cfg.eval, cfg.train
    when = "at step 0 and after the last step" if e.every >= t.max_steps else f"at step 0, every {e.every} steps and after the last"
    teacher = (f", beside the same questions asked with the teacher's prompt (privileged {'+'.join(cfg.prompts.privileged)})"
               if e.with_teacher_prompt else "")
    return f"the student's greedy accuracy on {e.num_samples} held-out questions (eval split) {when}{teacher}"


def first_row(stream: SampleStream) -> Sample | BadSample:
    """Row 0 of the first dataset's first file, the sample `--dry-run` shows too."""
    try:
        return stream.sources[0].sample(0)
    except BadSample as bad:
        return bad


def describe_first_sample(first: Sample | BadSample | None, cfg: Config) -> str:
    """The plan's view of the prompts: the first row's student and teacher prompts."""
    if first is None:
        return "  first sample: not shown, the data is not here yet (the run shows it at start)"
    if isinstance(first, BadSample):
        return f"  first sample: row 0 of the first dataset is not a usable sample ({first}); data.on_bad_sample decides"
    return describe_prompts(first, cfg.prompts)


def describe_lora(cfg: Config) -> str:
    lora = cfg.model.lora
    frozen = "; vision tower and connector frozen" if cfg.model.freeze_vision else ""
    if lora is None:
        return ("training all weights but the vision tower and connector (frozen)" if frozen else "training all weights")
    vision = f" + vision {'/'.join(lora.vision_target_modules)}" if lora.vision_target_modules else ""
    return (f"LoRA r={lora.rank} alpha={lora.alpha} dropout={lora.dropout} on {'/'.join(lora.target_modules)}{vision}, "
            f"base weights {lora.base_dtype}; engine sync: {cfg.rollout.lora_sync}{frozen}")


def describe_memory(cfg: Config, world_size: int, device_gb: float | None) -> str:
    try:
        return plan_memory(cfg, world_size, device_gb).describe()
    except FileNotFoundError as err:
        if cfg.model.build and not (Path(cfg.model.path) / "config.json").is_file():
            return f"memory plan: skipped, {cfg.model.path} is built at the first run (model.build: {cfg.model.build})"
        if cfg.teacher.build:
            return f"memory plan: skipped, {cfg.teacher.path} is built at the first run (teacher.build: {cfg.teacher.build})"
        return f"memory plan: skipped, {err}"


def main(argv: list[str] | None = None, final_line: Callable[[Callable[[], str]], None] | None = None) -> int:
    """The CLI; returns the exit status. `final_line(line)`: how the last line of a stopped run is
    written (`line()` gives it, with the seconds since the signal as of that call); default: at once."""
    args = parse_args(argv)
    try:
        cfg = load_args_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:  # the files, splits and columns, from the first rows of each split (seconds, not a full read)
            data_lines, first = peek_data(cfg, with_eval=cfg.eval.every > 0)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        print(describe_plan(cfg))
        print("\n".join([*(f"  data check: {line}" for line in data_lines), describe_first_sample(first, cfg)]))
        print(describe_memory(cfg, args.world_size or process_world_size(), args.gpu_memory_gb or detected_device_gb()))
        return 0
    try:
        if args.check:
            from opsd.check import run_check

            return 0 if run_check(cfg) else 1
        train(cfg)
    except (CheckpointError, ConfigError, BadSampleError, UnsupportedModelError, NonFiniteStepsError, OutputDirInUse,
            RewardError, DeviceError) as err:
        # a bad checkpoint, data not fitting the config, a bad row, a model scoring cannot reproduce,
        # a failed save (the disk), a loss that stayed non-finite, an output directory in use, a
        # reward function that fails, a device this machine lacks
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EngineLostError as err:  # a dead or frozen rollout server: like a lost rank, after a save
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RANK_LOST
    except RunStopped as stopped:  # the status tells the scheduler; the line tells the user
        if process_rank() == 0:
            resume = "; continue with checkpoint.resume_from=auto" if stopped.checkpoint else ""
            line = lambda: f"{stopped}{resume} (exit status {EXIT_STOPPED})"  # noqa: E731
            if final_line is None:
                print(line(), file=sys.stderr)
            else:
                final_line(line)
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main(final_line=_FINAL_LINES.append))  # a stop's last line at the process's exit
