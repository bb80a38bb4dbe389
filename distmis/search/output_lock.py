"""One search at a time in an output folder: ``OUTPUT/.distmis.lock``, held with ``flock`` while a search runs.

``distmis run`` and ``distmis compare`` (``--resume`` or not, and so a ``distmis submit`` job, which runs
``distmis run`` on the cluster's head) take the lock before anything else, and hold it until they end. A second one
into the same folder is refused at once (exit 2), naming the process that holds it, before its data is converted or
Ray starts: two searches would write the same state file, MLflow runs and Tune experiment.

The lock is the kernel's (``flock(2)``): it goes with the process, however it ends. A driver killed with SIGKILL
leaves the file (with the dead process's pid in it), never a lock; the next run takes it. The file is written by
distmis alone and removed at the end; a folder this made only to hold it is removed too when nothing else went in.
The file descriptor is not inherited by the processes a search starts (Python opens files non-inheritable), so a
Ray process that outlives its driver holds nothing. On a network file system, ``flock`` locks across machines only
where the file system supports it (NFS v4 does); where it cannot lock at all (Lustre mounted without ``flock``),
the search runs unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from distmis.search.state import SearchStateError

logger = logging.getLogger(__name__)

LOCK_FILE = ".distmis.lock"
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # a file system without flock


class OutputInUse(SearchStateError):
    """Another distmis process holds the output folder's lock (exit 2, nothing started)."""


@dataclass(frozen=True)
class OutputLock:
    """A held lock: ``locked`` False when the folder cannot be written (the lock file cannot be made; the
    search's own checks refuse such a folder) or its file system cannot lock; ``made_folder``: the folder did not
    exist and was made for the lock (None: no lock, nothing made)."""

    path: Path
    locked: bool
    made_folder: bool | None


@contextmanager
def output_locked(output_dir: str | Path, command: str) -> Iterator[OutputLock]:
    """Hold ``output_dir``'s lock while the block runs (``command``: what holds it, e.g. ``distmis run``, as a
    refused process names it); OutputInUse when another process holds it."""
    folder = Path(output_dir).absolute()
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # the folders made for the lock, deepest first
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = _acquire(path)
    except OutputInUse:
        _remove_if_empty(made)
        raise
    except OSError as exc:  # not a folder, or not writable: the search's checks name it (preflight)
        if exc.errno in UNSUPPORTED:
            logger.warning("%s cannot be locked (%s): a second search into it would not be refused", folder,
                           exc.strerror)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        _remove_if_empty(made)
        yield OutputLock(path, locked=False, made_folder=None)
        return
    try:
        _describe(descriptor, command)
        yield OutputLock(path, locked=True, made_folder=bool(made))
    finally:
        _release(descriptor, path)
        _remove_if_empty(made)


def _acquire(path: Path) -> int:
    """A descriptor of ``path`` holding its exclusive lock. The file another process unlinked (its release) between
    this one's open and lock is not the lock any more: open it again."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            folder = path.parent
            raise OutputInUse(
                f"{folder} is in use by another distmis{holder} ({path}); nothing was started. Two searches in one "
                "output folder would write over each other: wait for it to end (or stop it), or give another "
                "--output") from None
        except BaseException:
            os.close(descriptor)
            raise
        if _same_file(descriptor, path):
            return descriptor
        os.close(descriptor)


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether ``path`` is still the file ``descriptor`` has open."""
    try:
        held, named = os.fstat(descriptor), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _describe(descriptor: int, command: str) -> None:
    """Who holds the lock, for a refused process to name: pid, host, command and since when (no arguments: they
    may hold a secret). The lock holds without it (a full disk)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass


def _holder(descriptor: int) -> str:
    """`` (pid 123 on HOST: distmis run, since ...)``, as the holder wrote it; empty when it is not known (yet)."""
    try:
        record = json.loads(os.pread(descriptor, 4096, 0).decode())
        return f" (pid {int(record['pid'])} on {record['host']}: {record['command']}, since {record['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _release(descriptor: int, path: Path) -> None:
    """Remove the lock file while still holding it (a process waiting on it then opens a new one), then let go."""
    try:
        if _same_file(descriptor, path):
            path.unlink()
    except OSError:
        pass  # gone with its folder (a failed preparation removes the folder it made)
    finally:
        os.close(descriptor)


def _remove_if_empty(made: list[Path]) -> None:
    """The folders made only for the lock (deepest first), those that nothing else went in."""
    for folder in made:
        try:
            folder.rmdir()
        except FileNotFoundError:  # gone with a failed preparation, which removes the output folder it made
            continue
        except OSError:  # something else is in it: it stays, and so do the folders above
            return
