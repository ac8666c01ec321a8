"""Evaluate a checkpoint or a model directory exactly as training evaluates, without training.

    python -m opsd.evaluate --checkpoint runs/facts-opsd/checkpoint-10 --out runs/facts-eval   # the run's config
    python -m opsd.evaluate --config configs/learn_facts_smollm2.yaml --out runs/facts-eval-base  # model.path
    python -m opsd.evaluate --config X.yaml --model DIR --out DIR [--num-samples N] [dotted.key=value ...]

The same code as training's evaluation (opsd/evaluation.py's `Evaluator`): the configured engine
answers the first `eval.num_samples` usable rows of the eval splits greedily, from the student's
prompt and (with `eval.with_teacher_prompt`) the teacher's, judged with `eval.answer_pattern`; the
retention probes run when `eval.retention` is set. It prints the accuracies and writes every
completion with its extracted answer and whether it matched to `OUT/eval/step_{N}.jsonl` (N: the
checkpoint's step, 0 for a model directory), the file a run writes at each evaluation.
What vLLM and transformers print goes to `OUT/evaluate.log`. Single process; the student's
weights answer both prompts, as in training (a checkpoint's teacher weights are not used).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from opsd.config import Config, ConfigError, apply_overrides, config_from_dict, load_config
from opsd.data.errors import BadSampleError
from opsd.device import DeviceError
from opsd.trainer.checkpoint import CheckpointError, read_trainer_state, resolve_checkpoint
from opsd.trainer.console import third_party_output

EVALUATE_LOG = "evaluate.log"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opsd.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (default with --checkpoint: the config the run saved in it)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", help="an opsd checkpoint-{step} directory, or a run directory (its newest checkpoint): "
                                            "its student is evaluated")
    model.add_argument("--model", help="a Hugging Face model directory (sets model.path)")
    parser.add_argument("--out", required=True, help="directory for eval/step_{N}.jsonl and evaluate.log")
    parser.add_argument("--num-samples", type=int, help="items of the eval splits (sets eval.num_samples)")
    parser.add_argument("--verbose", action="store_true", help="also show third-party output on the console")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args, extra = parser.parse_known_args(argv)  # overrides may stand between options
    if any(a.startswith("-") or "=" not in a for a in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides += extra
    return args


def evaluate_config(args: argparse.Namespace) -> tuple[Config, int]:
    """The config to evaluate with, and the step the records are filed under."""
    overrides = list(args.overrides) + ([f"eval.num_samples={args.num_samples}"] if args.num_samples is not None else [])
    step, model_dir = 0, args.model
    if args.checkpoint:
        from opsd.dumps.offline import resolve_model_dirs

        dirs = resolve_model_dirs(args.checkpoint)
        step, model_dir = dirs.step, dirs.student
    if args.config:
        cfg = load_config(args.config, overrides)
    elif args.checkpoint and step:  # a checkpoint (not a plain model directory) holds its run's config
        cfg = config_from_dict(apply_overrides(read_trainer_state(resolve_checkpoint(Path(args.checkpoint)))["config"],
                                               overrides))
    else:
        raise ConfigError("evaluate needs --config (or --checkpoint of an opsd run, whose config it holds)")
    if model_dir:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_dir, build=None))
    return cfg, step


def run_evaluation(cfg: Config, out: str | Path, step: int = 0, *, log_file: Path | None = None) -> tuple[dict, Path]:
    """Build the engine (and, for retention probes, the trainer's model) and evaluate once: the metrics
    and the records' file."""
    import torch

    from opsd.device import resolve_device
    from opsd.evaluation import Evaluator
    from opsd.modeling import load_model, load_processor, prepare_model_dir
    from opsd.prompts import is_multimodal
    from opsd.rollout import make_engine
    from opsd.sequences import prompt_length_check
    from opsd.trainer.console import native_output_to_log

    model_dir = prepare_model_dir(cfg.model)
    processor = load_processor(cfg.model)
    check = prompt_length_check(processor, cfg.prompts, cfg.train.max_forward_tokens)
    evaluator = Evaluator(cfg, processor, check=check, multimodal=is_multimodal(processor), output_dir=out)
    student = load_model(cfg.model, processor, resolve_device(cfg.train.device)).eval() if cfg.eval.retention else None
    with native_output_to_log(log_file):
        engine = make_engine(cfg, model_dir, processor)
    try:
        with torch.no_grad():
            metrics = evaluator.run(step, engine, None, student)
    finally:
        engine.close()
    return metrics, evaluator.last_file


def format_metrics(metrics: dict) -> str:
    def share(key: str) -> str:
        return f"{metrics[key]:.3f}" if key in metrics else "-"

    line = (f"eval on {metrics['eval/num_samples']} items: accuracy {share('eval/accuracy')} "
            f"(answered {share('eval/answered')})")
    if "eval/teacher_accuracy" in metrics:
        line += f"; teacher prompt: accuracy {share('eval/teacher_accuracy')} (answered {share('eval/teacher_answered')})"
    if "eval/retention_accuracy" in metrics:
        line += f"; retention: accuracy {share('eval/retention_accuracy')}, nll {share('eval/retention_nll')}"
    return line + f" in {metrics['time_eval_s']:.1f} s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.num_samples is not None and args.num_samples < 1:
            raise ConfigError(f"--num-samples must be at least 1 (got {args.num_samples})")
        cfg, step = evaluate_config(args)
        verbose = args.verbose or cfg.logging.verbose
        with third_party_output(args.out, verbose=verbose, log_name=EVALUATE_LOG) as log_file:
            metrics, records = run_evaluation(cfg, args.out, step, log_file=None if verbose else log_file)
    except (ConfigError, FileNotFoundError, CheckpointError, BadSampleError, DeviceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{cfg.model.path} (step {step}): {format_metrics(metrics)}")
    print(f"wrote {records} (each item's completion, extracted answer and match); third-party output: {log_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
