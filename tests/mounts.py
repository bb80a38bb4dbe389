"""Small tmpfs mounts, for tests of a full disk and a read-only one (permission bits would not do: tests run as root
here, and root writes through them).

Mounting needs root (CAP_SYS_ADMIN). Where it is not permitted, :func:`unwritable_folder` falls back to permission
bits (which do stop a user other than root), and :func:`tmpfs` skips its test, saying so: what those tests check
without a mount is tested in tests/data/test_disk_space.py (a disk without room refused, on the test's own disk; a
full disk told from other errors, and its message).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(path: Path, options: str) -> str | None:
    """Mount a tmpfs with ``options`` at ``path`` (made if missing): None, or why it could not be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True)
    return None if mounted.returncode == 0 else (mounted.stderr.strip() or "mount failed")


def _unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # a process of the test still in it


@contextmanager
def tmpfs(path: Path, *, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's units: ``512k``, ``2m``) mounted at ``path`` for the block, then unmounted."""
    refused = _mount(path, f"size={size}" + (",ro" if read_only else ""))
    if refused is not None:
        pytest.skip(f"this test mounts a small tmpfs, which needs root (CAP_SYS_ADMIN): {refused}")
    try:
        yield path
    finally:
        _unmount(path)


@contextmanager
def unwritable_folder(path: Path) -> Iterator[tuple[Path, str]]:
    """A folder no file can be made in, for the block: ``(folder, the system's reason)``. A read-only tmpfs
    (``Read-only file system``) where mounting is permitted; else, for a user other than root, permission bits
    (``Permission denied``); root without the right to mount skips the test, saying so."""
    refused = _mount(path, "size=64k,ro")
    if refused is None:
        try:
            yield path, os.strerror(errno.EROFS)
        finally:
            _unmount(path)
        return
    if os.geteuid() == 0:
        pytest.skip(f"root without CAP_SYS_ADMIN ({refused}): no read-only mount, and root writes through "
                    "permission bits")
    path.chmod(0o555)
    try:
        yield path, os.strerror(errno.EACCES)
    finally:
        path.chmod(0o755)
