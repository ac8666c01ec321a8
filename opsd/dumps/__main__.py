"""Rollout dumps and their analysis: what the student samples and where the teacher disagrees.

    python -m opsd.dumps dump --config configs/smoke.yaml --out runs/dumps/real [--checkpoint DIR]
                              [--num-samples N] [--split train|eval] [dotted.key=value ...]
    python -m opsd.dumps dump --model DIR --data DIR --out DIR          # a model directory alone
    python -m opsd.dumps analyze DIR [--compare DIR2] [--out PLOTS_DIR] [--top N]

`dump` samples completions with the configured engine and scores them with the student and the
teacher prompts, without training, into `DIR/step_{N}_rank_0.parquet` (the format training writes
with `logging.dump_rollouts_every`). `analyze` reads a dump directory or a run directory (its
`rollouts/`), prints a summary and writes PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from opsd.config import Config, ConfigError, apply_overrides, config_from_dict, load_config
from opsd.device import DeviceError
from opsd.trainer.checkpoint import CheckpointError
from opsd.trainer.console import third_party_output

DUMP_LOG = "dump.log"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opsd.dumps", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    dump = commands.add_parser("dump", help="sample and score a dataset without training")
    dump.add_argument("--config", help="YAML config (default: built-in defaults, needs --model and --data)")
    model = dump.add_mutually_exclusive_group()
    model.add_argument("--model", help="Hugging Face model directory to sample and score with (sets model.path)")
    model.add_argument("--checkpoint", help="an opsd checkpoint-{step} directory (or a run directory: its newest "
                                            "checkpoint): the student from it, the teacher as the run had it (EMA "
                                            "weights, the student, or the run's model.path for a fixed teacher)")
    dump.add_argument("--data", help="data directory in the project schema (sets data.path, replaces data.datasets)")
    dump.add_argument("--out", required=True, help="directory for step_{N}_rank_0.parquet")
    dump.add_argument("--num-samples", type=int, default=32, help="prompts to take from the split (default 32)")
    dump.add_argument("--split", default="train", help="train or eval: the datasets' split or eval_split (default train)")
    dump.add_argument("--verbose", action="store_true",
                      help="also show third-party output (vLLM, transformers) on the console; it always goes to OUT/dump.log")
    dump.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")

    analyze = commands.add_parser("analyze", help="summarise dumps and plot them")
    analyze.add_argument("dir", help="dump directory, or a run directory with rollouts/")
    analyze.add_argument("--compare", help="a second dump or run directory to put side by side")
    analyze.add_argument("--out", help="directory for the PNG plots (default: DIR/plots)")
    analyze.add_argument("--top", type=int, default=10, help="tokens and contexts listed (default 10)")
    # Overrides may stand between options (`--out X key=value --num-samples 2 key=value`).
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "dump" or any(a.startswith("-") or "=" not in a for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    return args


def dump_config(args: argparse.Namespace, model_dir: str | None) -> Config:
    """The config file (or the defaults), with --data and the model directory of --model/--checkpoint."""
    overrides = list(args.overrides) + ([f"data.path={args.data}", "data.datasets=[]"] if args.data else [])
    if args.config:
        cfg = load_config(args.config, overrides)
    elif model_dir and args.data:
        cfg = config_from_dict(apply_overrides({"model": {"path": model_dir}, "data": {"path": args.data}}, overrides))
    else:
        raise ConfigError("dump needs --config, or --model (or --checkpoint) and --data")
    if model_dir:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_dir, build=None))
    return cfg


def run_dump(args: argparse.Namespace) -> int:
    from opsd.dumps.offline import dump_rollouts, resolve_model_dirs

    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be at least 1 (got {args.num_samples})")
    source = args.model or args.checkpoint
    dirs = resolve_model_dirs(source) if source else None
    cfg = dump_config(args, dirs.student if dirs else None)
    verbose = args.verbose or cfg.logging.verbose
    with third_party_output(args.out, verbose=verbose, log_name=DUMP_LOG) as log_file:  # like training's run.log
        path, counts = dump_rollouts(
            cfg, args.out, num_samples=args.num_samples, split=args.split,
            teacher_path=dirs.teacher if dirs else None, step=dirs.step if dirs else 0,
            log_file=None if verbose else log_file,
        )
    dropped = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    print(f"wrote {path}" + (f" ({dropped})" if dropped else "") + f"; third-party output: {log_file}")
    return 0


def run_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from opsd.dumps.analysis import format_report, load_rollouts, paired_difference, summarize, write_plots

    runs = [load_rollouts(args.dir)]
    if args.compare:
        runs.append(load_rollouts(args.compare))
        if runs[0].label == runs[1].label:  # e.g. two runs/…/rollouts: tell them apart by their parents
            runs[0].label, runs[1].label = (str(Path(d)) for d in (args.dir, args.compare))
    summaries = [summarize(r, top=args.top) for r in runs]
    print(format_report(summaries, paired_difference(*runs) if args.compare else None))
    for path in write_plots(runs, summaries, args.out or Path(args.dir) / "plots"):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_dump(args) if args.command == "dump" else run_analyze(args)
    except (ConfigError, FileNotFoundError, CheckpointError, DeviceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
