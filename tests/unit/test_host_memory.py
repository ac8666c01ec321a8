"""opsd/trainer/host_memory.py: freed memory stays in the process, unless the user chose malloc's settings."""

import json
import os
import subprocess
import sys

import pytest

from opsd.trainer.host_memory import user_chose_malloc_settings, without_malloc_settings

# Allocates and touches 256 MiB with malloc, frees it, and reports the resident size before and after
# the free (MiB), and what `keep_freed_memory` returned (when asked to call it).
CHILD = """
import ctypes, ctypes.util, json, os, sys
from opsd.trainer.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
size = 256 * 2**20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
touched = rss_mib()
libc.free(block)
print(json.dumps({"kept": kept, "touched": touched, "freed": rss_mib()}))
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc's malloc only"
)


def run_child(mode: str, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], env={**without_malloc_settings(), **env}, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


@glibc
def test_freed_memory_stays_resident_once_kept():
    kept = run_child("keep")
    assert kept["kept"] is True
    assert kept["touched"] - kept["freed"] < 16  # the 256 MiB block stayed in the process

    default = run_child("default")  # glibc's own: a block this large is unmapped when freed
    assert default["touched"] - default["freed"] > 200


@glibc
def test_a_users_malloc_settings_are_left_alone():
    run = run_child("keep", MALLOC_MMAP_MAX_="65536")
    assert run["kept"] is False
    assert run["touched"] - run["freed"] > 200


def test_user_choices_are_read_from_the_environment():
    assert not user_chose_malloc_settings({})
    assert user_chose_malloc_settings({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert not user_chose_malloc_settings(without_malloc_settings(
        {"MALLOC_TOP_PAD_": "1", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0", "PATH": "/bin"}))
