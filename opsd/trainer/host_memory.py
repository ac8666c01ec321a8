"""Keep the memory a CPU training process frees for its own reuse, instead of handing it back.

Each step frees and allocates again gigabytes of activations, gradients and logits. glibc's malloc
returns large freed blocks to the system (`munmap`, heap trimming), so the next step faults the same
amount back in and the kernel zeroes every page of it again. On the 2-core CI machines (virtual
machines) that zeroing took most of some steps, processes at about 90% system time; kept, the pages
are faulted in once, in the first steps, and reused after: the training stage from step 3 took 0.79x
as long (bench/side_by_side.py; docs/training.md, "Host memory on CPU").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""mallopt(3) parameters (glibc's malloc.h)."""

USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
"""glibc's environment variables for the same settings: a user who sets one (or a malloc tunable in
GLIBC_TUNABLES) has chosen, and this module leaves malloc alone."""


def user_chose_malloc_settings(environ=os.environ) -> bool:
    return any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def without_malloc_settings(environ=os.environ) -> dict[str, str]:
    """`environ` less glibc's malloc variables and tunables: a child process started with it makes
    the recipe's own choice (what a benchmark or a test of that choice needs)."""
    return {k: v for k, v in environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep what the process frees: no `mmap` for large blocks (they come from
    the heap and go back to it) and no trimming of the heap's top. Returns whether it was set; not on
    another C library, or where the user set malloc's variables themselves. The resident size then
    stays at the run's peak until the process exits."""
    if user_chose_malloc_settings():
        return False
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path) if path else None
    except OSError:
        libc = None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False  # mallopt's parameters below are glibc's
    # -1: never trim (mallopt(3)); 0: no block served by mmap, so none is unmapped on free
    return bool(libc.mallopt(M_TRIM_THRESHOLD, -1)) and bool(libc.mallopt(M_MMAP_MAX, 0))
