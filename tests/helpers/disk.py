"""A directory on a small file system, for saves that fill the disk (tests only)."""

import contextlib
import errno
import subprocess

import torch.distributed.checkpoint.filesystem as dcp_filesystem

from opsd.trainer import checkpoint as ckpt

SMALL_FS_MB = 20
"""A tiny text model's checkpoint takes 12.4 MB: one fits, a second does not."""


@contextlib.contextmanager
def small_file_system(where, monkeypatch, size_mb=SMALL_FS_MB):
    """(where, mounted): `where` on a `size_mb` file system: a tmpfs when this process may mount one (root),
    else a directory whose writes fail with ENOSPC once `size_mb` are written (DCP's writer patched)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                             capture_output=True).returncode == 0
    if not mounted:
        simulate_full_disk(where, size_mb * 1_000_000, monkeypatch)
    try:
        yield where, mounted
    finally:
        if mounted and subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)  # a file a failed writer left open


def simulate_full_disk(where, capacity, monkeypatch):
    """Without a tmpfs: writes of the training state (DCP) fail with ENOSPC once `capacity` bytes are
    used under `where`, and the free space reads what is left."""
    used = lambda: sum(f.stat().st_size for f in where.rglob("*") if f.is_file())  # noqa: E731
    real_write = dcp_filesystem._write_item

    def write_item(*args, **kwargs):
        if used() > capacity - 4_000_000:
            raise OSError(errno.ENOSPC, "No space left on device", str(where / "train_state" / "__0_0.distcp"))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    monkeypatch.setattr(ckpt, "free_mb", lambda path: max(0, capacity - used()) / 1e6)


def fill(directory) -> None:
    """Write a file into `directory` until its file system is full (ENOSPC)."""
    block = b"\0" * (1 << 16)
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
