"""Export a checkpoint's model as a clean Hugging Face directory.

    python -m opsd.export --checkpoint runs/demo/checkpoint-20 --out exported/demo [--ema]
    python -m opsd.export --checkpoint runs/demo --out exported/demo   # the run's newest checkpoint

The checkpoint is verified against its manifest first (every file present, sizes and small files'
sha256 as saved); the student's (or, with `--ema`, the EMA teacher's) directory is then copied to
`--out` through a temporary name, so `--out` appears complete or not at all. The result loads with
`from_pretrained` and `vllm.LLM`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from opsd.trainer.checkpoint import MODEL_DIR, TEACHER_DIR, CheckpointError, resolve_checkpoint, verify_checkpoint


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, ema: bool = False) -> Path:
    """Copy the verified model directory of `checkpoint` (a checkpoint or a run directory) to `out`."""
    source = resolve_checkpoint(Path(checkpoint))
    role = TEACHER_DIR if ema else MODEL_DIR
    manifest = verify_checkpoint(source, under=f"{role}/")
    if ema and manifest["teacher_mode"] != "ema":
        raise CheckpointError(f"checkpoint {source} has no EMA teacher: it was written with teacher.mode={manifest['teacher_mode']}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty")
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source / role, tmp)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-{step} directory, or a run's output directory (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="directory to create (must not exist or be empty)")
    parser.add_argument("--ema", action="store_true", help="export the EMA teacher's weights instead of the student's")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, ema=args.ema)
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {'EMA teacher' if args.ema else 'student'} of {resolve_checkpoint(Path(args.checkpoint))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
