"""Export a checkpoint's model as a clean Hugging Face directory.

    python -m opsd.export --checkpoint runs/demo/checkpoint-20 --out exported/demo [--ema]
    python -m opsd.export --checkpoint runs/demo --out exported/demo   # the run's newest checkpoint
    python -m opsd.export --checkpoint runs/lora --out exported/lora --merge   # LoRA: a full model

The checkpoint is verified against its manifest first (every file present, sizes and small files'
sha256 as saved); the student's (or, with `--ema`, the EMA teacher's) directory is then copied to
`--out` through a temporary name, so `--out` appears complete or not at all. The result loads with
`from_pretrained` and `vllm.LLM`. A LoRA run's checkpoint holds an adapter (PEFT directory): it is
exported as such, or with `--merge` as a full model directory, the adapter merged into the base
weights named by the adapter's `base_model_name_or_path` (or `--base`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from opsd.lora import is_adapter_dir
from opsd.teacher import TEACHER_DIR_WEIGHTS, saved_weights
from opsd.trainer.checkpoint import MODEL_DIR, TEACHER_DIR, CheckpointError, resolve_checkpoint, verify_checkpoint


def merge_adapter(adapter_dir: Path, out: Path, base: str | None = None) -> None:
    """Write the base model with the adapter of `adapter_dir` merged in, as a Hugging Face directory."""
    import torch
    from peft import PeftConfig, PeftModel

    from opsd.config import ConfigError, ModelConfig
    from opsd.modeling import load_model, load_processor

    base = base or PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    if not base:
        raise CheckpointError(f"{adapter_dir}: the adapter names no base model; give --base")
    model_cfg = ModelConfig(path=base)
    try:
        processor = load_processor(model_cfg)
        model = load_model(model_cfg, processor, torch.device("cpu"))
    except (OSError, ConfigError) as err:
        raise CheckpointError(f"--merge: cannot load the base model {base}: {err}") from None
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    processor.save_pretrained(out)


def readable_by_others(directory: Path) -> None:
    """Give every file and folder under `directory` the mode a new one gets from the umask (0644 /
    0755 under the usual 022): safetensors writes its files 0600, which other users and tools sharing
    the exported model could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, ema: bool = False, merge: bool = False,
                      base: str | None = None) -> Path:
    """Copy the verified model directory of `checkpoint` (a checkpoint or a run directory) to `out`;
    `merge`: a LoRA checkpoint's adapter merged into its base model."""
    source = resolve_checkpoint(Path(checkpoint))
    role = TEACHER_DIR if ema else MODEL_DIR
    manifest = verify_checkpoint(source, under=f"{role}/")
    mode = manifest["teacher_mode"]
    if ema and saved_weights(mode) != TEACHER_DIR_WEIGHTS:
        raise CheckpointError(f"checkpoint {source} has no EMA teacher: it was written with teacher.mode={mode}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty")
    tmp = out.with_name(out.name + ".tmp-export")
    if merge and not is_adapter_dir(source / role):
        raise CheckpointError(f"--merge: {source / role} holds full weights, not a LoRA adapter; export it without --merge")
    shutil.rmtree(tmp, ignore_errors=True)
    if merge:
        merge_adapter(source / role, tmp, base)
    else:
        shutil.copytree(source / role, tmp)
    readable_by_others(tmp)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint-{step} directory, or a run's output directory (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="directory to create (must not exist or be empty)")
    parser.add_argument("--ema", action="store_true", help="export the EMA teacher's weights instead of the student's")
    parser.add_argument("--merge", action="store_true", help="LoRA checkpoints: a full model, the adapter merged into the base")
    parser.add_argument("--base", help="with --merge: the base model (default: the adapter's base_model_name_or_path)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, ema=args.ema, merge=args.merge, base=args.base)
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {'EMA teacher' if args.ema else 'student'}{' (merged)' if args.merge else ''} of {resolve_checkpoint(Path(args.checkpoint))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
