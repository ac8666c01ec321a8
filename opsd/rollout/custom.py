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
import traceback

from opsd.config import ConfigError
from opsd.rollout.engine import EngineCapabilities

ENGINE_METHODS = ("generate", "begin_weight_update", "receive_weights", "end_weight_update", "close")
ABILITY_METHODS = ("release_memory", "receive_adapter")
"""The declared abilities (`EngineCapabilities` fields) that are methods the engine must have."""


def load_import_path(path: str):
    """`package.module:Name` (Name may be dotted: `mod:Outer.Inner`) -> the object it names."""
    module_name, _, attr_path = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):  # the module itself (or its package) is not there
            raise ConfigError(f"rollout.engine: cannot import module {module_name!r} of {path!r}: no module named "
                              f"{err.name!r} (is it installed, or on PYTHONPATH?)") from None
        raise ConfigError(f"rollout.engine: module {module_name!r} of {path!r} does not import: {_where(err)}") from None
    except Exception as err:  # the user's module raised while importing: name the line
        raise ConfigError(f"rollout.engine: module {module_name!r} of {path!r} does not import: {_where(err)}") from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ConfigError(f"rollout.engine: {path!r}: {obj.__name__} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def _where(err: BaseException) -> str:
    """`Type: message (file, line N)` of the frame that raised, for a one-line error."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        at = f" ({err.filename}, line {err.lineno})"
        return f"SyntaxError: {err.msg}{at}"
    return f"{type(err).__name__}: {err}{at}"


def _missing_methods(obj) -> list[str]:
    return [m for m in ENGINE_METHODS if not callable(getattr(obj, m, None))]


def build_custom_engine(cfg, model_path, processor):
    """Construct the engine `cfg.rollout.engine` names and check it has the engine's methods (a class
    is checked before it is built) and declares its optional abilities (with the methods of those it
    declares)."""
    path = cfg.rollout.engine
    factory = load_import_path(path)
    if not callable(factory):
        raise ConfigError(f"rollout.engine: {path!r} is not a class or function")
    missing = _missing_methods(factory) if isinstance(factory, type) else []
    if not missing:
        engine = factory(cfg=cfg, model_path=model_path, processor=processor)
        missing = _missing_methods(engine)
    if missing:
        name = factory.__name__ if isinstance(factory, type) else f"the {type(engine).__name__} it built"
        raise ConfigError(f"rollout.engine: {path!r}: {name} has no {', '.join(missing)} method; an engine needs "
                          f"{', '.join(ENGINE_METHODS)} (opsd/rollout/engine.py)")
    name = type(engine).__name__
    capabilities = getattr(engine, "capabilities", None)
    if not isinstance(capabilities, EngineCapabilities):
        raise ConfigError(
            f"rollout.engine: {path!r} built a {name} without `capabilities`: declare its optional abilities, "
            "`capabilities = opsd.rollout.EngineCapabilities()` for none, or `inner.capabilities` for a wrapped engine"
        )
    declared = [m for m in ABILITY_METHODS if getattr(capabilities, m)]
    unbacked = [m for m in declared if not callable(getattr(engine, m, None))]
    if unbacked:
        raise ConfigError(f"rollout.engine: {path!r}: {name}.capabilities declares {', '.join(unbacked)} "
                          f"but {name} has no such method (forward it to the wrapped engine)")
    return engine
