"""Small tmpfs mounts, for tests of a full disk and a read-only one (permission bits would not do: tests run as root
here, and root writes through them).

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted the test is skipped, saying so.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, *, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's units: ``512k``, ``2m``) mounted at ``path`` for the block, then unmounted."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this test mounts a small tmpfs, which needs root (CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)  # a process of the test still in it
