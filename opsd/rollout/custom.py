"""Rollout engines named by import path in the config (`rollout.engine: mypkg.mod:MyEngine`).

The named attribute is called as `Name(cfg=cfg, model_path=model_path, processor=processor)`:
the full run `Config`, the student's Hugging Face directory, and its processor (or tokenizer). It
is usually the engine class itself; a factory function works too. The object it returns must
implement the engine interface of opsd/rollout/engine.py, the weight-sync callbacks included.
"""

from __future__ import annotations

import importlib

ENGINE_METHODS = ("generate", "begin_weight_update", "receive_weights", "end_weight_update", "close")


def load_import_path(path: str):
    """`package.module:Name` (Name may be dotted: `mod:Outer.Inner`) -> the object it names."""
    module_name, _, attr_path = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"rollout.engine: cannot import module {module_name!r} of {path!r}: {err}") from err
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ImportError(f"rollout.engine: {path!r}: {obj.__name__} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def build_custom_engine(cfg, model_path, processor):
    """Construct the engine `cfg.rollout.engine` names and check it has the engine's methods."""
    path = cfg.rollout.engine
    factory = load_import_path(path)
    if not callable(factory):
        raise TypeError(f"rollout.engine: {path!r} is not a class or function")
    engine = factory(cfg=cfg, model_path=model_path, processor=processor)
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise TypeError(f"rollout.engine: {path!r} built a {type(engine).__name__} without {', '.join(missing)}")
    return engine
