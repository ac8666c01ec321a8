"""Rollout engines named by import path in the config (`rollout.engine: mypkg.mod:MyEngine`).

The named attribute is called as `Name(cfg=cfg, model_path=model_path, processor=processor)`:
the full run `Config`, the student's Hugging Face directory, and its processor (or tokenizer). It
is usually the engine class itself; a factory function works too. The object it returns must
implement the engine interface of opsd/rollout/engine.py (`RolloutEngine`), the weight-sync
callbacks included, and declare its optional abilities in `capabilities` (`EngineCapabilities()`:
none). An engine wrapping a built-in one builds it with `opsd.rollout.builtin_engine(cfg,
model_path, processor)` and keeps its abilities: `capabilities = inner.capabilities`, the
optional methods forwarded.
"""

from __future__ import annotations

import importlib

from opsd.rollout.engine import EngineCapabilities

ENGINE_METHODS = ("generate", "begin_weight_update", "receive_weights", "end_weight_update", "close")
ABILITY_METHODS = ("release_memory", "receive_adapter")
"""The declared abilities (`EngineCapabilities` fields) that are methods the engine must have."""


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
    """Construct the engine `cfg.rollout.engine` names and check it has the engine's methods and
    declares its optional abilities (with the methods of those it declares)."""
    path = cfg.rollout.engine
    factory = load_import_path(path)
    if not callable(factory):
        raise TypeError(f"rollout.engine: {path!r} is not a class or function")
    engine = factory(cfg=cfg, model_path=model_path, processor=processor)
    name = type(engine).__name__
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise TypeError(f"rollout.engine: {path!r} built a {name} without {', '.join(missing)}")
    capabilities = getattr(engine, "capabilities", None)
    if not isinstance(capabilities, EngineCapabilities):
        raise TypeError(
            f"rollout.engine: {path!r} built a {name} without `capabilities`: declare its optional abilities, "
            "`capabilities = opsd.rollout.EngineCapabilities()` for none, or `inner.capabilities` for a wrapped engine"
        )
    declared = [m for m in ABILITY_METHODS if getattr(capabilities, m)]
    unbacked = [m for m in declared if not callable(getattr(engine, m, None))]
    if unbacked:
        raise TypeError(f"rollout.engine: {path!r}: {name}.capabilities declares {', '.join(unbacked)} "
                        f"but {name} has no such method (forward it to the wrapped engine)")
    return engine
