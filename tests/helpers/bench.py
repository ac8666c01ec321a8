"""Load a bench/ script as a module (bench/ is not a package), for tests of its report code."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
