"""A quiet console: opsd's own lines on the terminal, third-party output in `<output_dir>/run.log`.

vLLM, transformers, datasets and Python warnings log through the `logging` root, whose handler here
writes each distinct message once to the log file (vLLM repeats some on every request); with
`verbose` they also go to stderr. transformers' and datasets' progress bars (loading weights,
writing model shards) are turned off unless `verbose`. Output that bypasses Python, such as
PyTorch's C++ warnings while the engine starts (NUMA binding), is caught with `native_output_to_log`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

THIRD_PARTY_LOG = "run.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OnceFilter(logging.Filter):
    """Passes each distinct (logger, message) once."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextmanager
def third_party_output(output_dir: str | Path, *, verbose: bool = False, log_name: str = THIRD_PARTY_LOG):
    """Route third-party logging and warnings to `<output_dir>/<log_name>` (and stderr when `verbose`)
    for the duration; yields the log file's path."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's loggers then propagate to the root
    path = Path(output_dir) / log_name
    path.parent.mkdir(parents=True, exist_ok=True)
    handlers = [logging.FileHandler(path)] + ([logging.StreamHandler(sys.stderr)] if verbose else [])
    root = logging.getLogger()
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(OnceFilter())
        root.addHandler(handler)
    logging.captureWarnings(True)
    restore_libraries = _libraries_through_root(progress_bars=verbose)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # each warning once per place, into the log
            yield path
    finally:
        restore_libraries()
        logging.captureWarnings(False)
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def _libraries_through_root(*, progress_bars: bool):
    """vLLM (when already imported and configured), transformers and datasets log through the root
    instead of their own stderr handlers; the progress bars of the last two are off unless asked.
    Returns the undo."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    undo = []
    for name, lib in (("vllm", None), ("transformers", transformers_logging), ("datasets", datasets_logging)):
        logger = logging.getLogger(name)
        bars_were_on = lib is not None and lib.is_progress_bar_enabled()
        undo.append((logger, logger.handlers[:], logger.propagate, lib, bars_were_on))
        logger.handlers, logger.propagate = [], True
        if lib is not None and not progress_bars:
            lib.disable_progress_bar()

    def restore():
        for logger, handlers, propagate, lib, bars_were_on in undo:
            logger.handlers, logger.propagate = handlers, propagate
            if bars_were_on:
                lib.enable_progress_bar()

    return restore


@contextmanager
def native_output_to_log(log_file: Path | None):
    """Send this process's file descriptors 1 and 2, and `sys.stdout` / `sys.stderr`, to `log_file`
    for the duration (None: leave them).

    For native code that prints past Python's `logging` (vLLM's engine start: C++ warnings, its own
    progress bars), and Python code that prints to a `sys.stderr` that is not descriptor 2 (a
    notebook, a test's capture). Python's exceptions still reach the console: they are printed
    after it ends.
    """
    if log_file is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_file, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        with open(log_file, "a", buffering=1) as log, redirect_stdout(log), redirect_stderr(log):
            yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
