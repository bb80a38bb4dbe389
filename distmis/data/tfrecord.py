"""Offline binarisation into sharded TFRecords, and reading them back with tf.data.

The training pipeline never touches NIfTI: :func:`convert_to_tfrecords` reads
and preprocesses every case once (in parallel worker processes that only use
numpy / nibabel / scipy) and the parent process writes them into sharded
TFRecord files, one set per part of the split (:func:`~distmis.data.split.split_parts`: ``train``, ``val`` and
``test``, or with cross-validation folds ``fold0``, ..., ``fold{k-1}`` and ``test``)::

    out_dir/manifest.json
    out_dir/train-00000-of-00002.tfrecord
    out_dir/train-00001-of-00002.tfrecord
    out_dir/val-00000-of-00001.tfrecord
    ...                                      (or fold0-00000-of-00001.tfrecord, fold1-..., test-...)

Each record is a ``tf.train.Example`` with the features

* ``case_id``: bytes (UTF-8);
* ``image``: raw little-endian float32 bytes of the ``(h, w, d, 4)`` image;
* ``label``: raw uint8 bytes of the ``(h, w, d, C)`` binary target;
* ``image_shape``, ``label_shape``: int64 lists.

``manifest.json`` records the format version, the preprocessing config, the
(common) shapes and dtypes, the split (``"split"``, with its ``"folds"`` if any) and, per part
(``"splits"``, keyed ``train`` ... or ``fold0`` ...), the case ids and the shards with their sha256
checksums (see :func:`verify_checksums`).

The output folder appears whole or not at all: the shards are written into a
hidden ``.{out}.partial-{pid}-{tag}`` folder beside it, renamed into place at the
end.  That folder holds a marker file (:data:`PARTIAL_MARKER`) locked by the
writing process for as long as it lives; the next conversion into the same
parent folder removes a partial folder whose marker nobody holds (its writer
was killed), deleting only the files distmis writes there, and never touches
one whose writer still runs.  The reader processes die with the process that
started them, even when it is killed.

``overwrite`` replaces only what distmis wrote: the plain files the existing
folder's manifest lists, and the manifest.  A folder that holds anything else
(an unlisted file or folder, a symlink, even one the manifest names) is refused
with an error naming it, and nothing is deleted.

:func:`make_dataset` builds the training input pipeline (interleave -> parse
-> cache -> shuffle -> random tile crop -> batch -> prefetch), deterministic
for a seed; :func:`iter_cases` yields whole volumes for validation. Both read
one part (``"train"``) or the union of several (``["fold0", "fold2"]``: a
cross-validation trial's training folds).

The records are written and read without TensorFlow (:mod:`distmis.data.records`): a torch search never
imports it. TensorFlow is imported inside :func:`make_dataset` only, the Keras trainer's input pipeline.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from distmis.data.case_progress import CaseProgress
from distmis.data.disk_space import Room, check_room, full_disk_error, is_disk_full
from distmis.data.errors import DataError
from distmis.data.layouts import MODALITIES, CaseFiles, read_case
from distmis.data.manifest import FORMAT_VERSION, MANIFEST_NAME, DataManifest, read_manifest
from distmis.data.preprocess import PreprocessConfig, preprocess_case
from distmis.data.records import parse_example, read_records, serialize_example, write_record
from distmis.data.split import part_names, split_parts, validate_split

if sys.platform != "win32":
    import fcntl

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

    from distmis.spec.schema import AugmentSpec

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PARTIAL_MARKER",
    "CASES_PER_SHARD",
    "convert_to_tfrecords",
    "remove_leftovers",
    "read_manifest",
    "verify_checksums",
    "make_dataset",
    "iter_cases",
]

#: Name of the marker file in a folder being written (``.{out}.partial-{pid}-{tag}``): its writer holds an
#: exclusive lock on it while it lives, so a marker nobody holds marks a leftover of a killed conversion.
PARTIAL_MARKER = ".distmis-writing"
#: Default maximum number of cases per shard.
CASES_PER_SHARD = 8
#: Maximum number of shards read concurrently by :func:`make_dataset` (a
#: constant, not the CPU count, so the element order is the same on every machine).
INTERLEAVE_CYCLE = 4

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)

#: Linux prctl option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1
#: How often a reader process checks that its parent lives (where the kernel cannot tell it).
_PARENT_POLL_S = 0.5
#: A partial folder without a proven marker is removed only when empty, its pid gone, and older than this.
_ABANDONED_AFTER_S = 60.0
_SHARD_FILE = re.compile(r"(?:train|val|test|fold\d+)-\d{5,}-of-\d{5,}\.tfrecord")
_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})")
#: ``pid-tag`` of the folders this process is writing (a lock this process holds may not conflict with
#: itself where flock is emulated with POSIX locks, as on NFS).
_WRITING_HERE: set[str] = set()


def _tf() -> Any:
    """Import TensorFlow quietly (only for the Keras trainer's input pipeline)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def shard_name(split: str, index: int, count: int) -> str:
    """``train-00000-of-00002.tfrecord``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def _shard_sizes(num_cases: int, shards_per_split: int | None) -> list[int]:
    """Balanced number of cases per shard (earlier shards get the extra case)."""
    if num_cases == 0:
        return []
    count = math.ceil(num_cases / CASES_PER_SHARD) if shards_per_split is None else shards_per_split
    count = max(1, min(count, num_cases))
    base, extra = divmod(num_cases, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- workers


def _die_with_parent(parent: int) -> None:
    """Pool initializer: end this reader process as soon as ``parent`` (the process that started it) ends.

    A killed parent runs no cleanup, and a spawn worker waiting on its task queue would wait for ever. On
    Linux the kernel sends SIGKILL on the parent's death (``PR_SET_PDEATHSIG``; the pool is started by the
    thread that converts, which outlives it). Everywhere, a daemon thread also polls the parent pid.
    """
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the thread below still watches
            pass
    if os.getppid() != parent:  # the parent died before the kernel was told
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="distmis-watch-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)  # re-parented: the converting process has died


@contextmanager
def _ctrl_c_held_while_readers_start() -> Iterator[None]:
    """Ctrl-C held back while the reader processes are started, then acted on.

    A terminal's Ctrl-C reaches its whole process group: a reader still importing its modules would print a
    KeyboardInterrupt traceback. SIGINT is therefore blocked in this thread while the readers are started, and
    a process inherits its starter's blocked signals: the readers never take it (the converting process
    handles Ctrl-C and stops them). A Ctrl-C that arrives meanwhile is not lost: it is recorded, whether it waited
    for this thread to unblock it or another thread of this process took it (Python runs its handler in the main
    thread even while that thread blocks the signal), and passed on once the readers have started.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # starting the tracker unblocks SIGINT in the calling thread
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only;
        try:  # a SIGINT then runs the main thread's handler as ever
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        # unblocked first: a SIGINT that waited is recorded too (signal.signal runs the handler of a pending one
        # before it swaps), and nothing raises before the mask is as it was
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if received:
            _pass_on_ctrl_c(previous)


def _pass_on_ctrl_c(handler: Any) -> None:
    """What a SIGINT received while it was held back would have done under ``handler``."""
    if callable(handler):
        handler(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt
    elif handler in (signal.SIG_DFL, None):
        signal.raise_signal(signal.SIGINT)


IN_PROCESS_BYTES = 16 * 2**20
"""Below this much data (its files on disk, and its records), the conversion reads in its own process: a reader
process takes one to two seconds to start (a new interpreter and its imports), more than reading it all."""


def default_readers(cases: Sequence[CaseFiles], record_bytes: int | None) -> int:
    """The reader processes a conversion of ``cases`` uses by default: ``min(CPUs, 4)``, or 1 (in-process) for a
    small data set, both its files and its records (``record_bytes``, None when not known) under
    :data:`IN_PROCESS_BYTES`."""
    def file_bytes() -> int:
        total = 0
        for case in cases:
            for path in (*case.images, case.label):
                try:
                    total += Path(path).stat().st_size
                except OSError:  # the reading names it
                    pass
                if total > IN_PROCESS_BYTES:
                    break
        return total

    if record_bytes is not None and record_bytes <= IN_PROCESS_BYTES and file_bytes() <= IN_PROCESS_BYTES:
        return 1
    return min(os.cpu_count() or 1, 4)


def _load_case(case: CaseFiles, job: tuple[PreprocessConfig, Any]) -> tuple[str, np.ndarray, np.ndarray]:
    """Worker: read and preprocess one case (numpy / nibabel / scipy only). ``job``: the preprocessing and the data
    set's description (None: the layout's own)."""
    from distmis.data.layouts import case_orientation

    config, description = job
    image, label, spacing = read_case(case, description if description is not None else config.layout)
    axcodes = case_orientation(case) if config.orientation is not None else None
    try:
        image, target = preprocess_case(image, label, config, spacing, axcodes)
    except DataError:
        raise
    except ValueError as exc:
        raise DataError(f"case {case.case_id!r} ({str(case.images[0])!r}): preprocessing failed: {exc}") from exc
    return case.case_id, image, target


def _ordered_map(fn: Callable[..., R], items: Sequence[T], config: Any, workers: int) -> Iterator[R]:
    """``fn(item, config)`` for every item, in order, with at most ``2 * workers`` results in flight.

    Uses a *spawn* process pool, so that workers start clean even if the parent
    has already loaded TensorFlow (forking a multi-threaded process can deadlock);
    the workers die with the calling process (:func:`_die_with_parent`).
    ``workers <= 1`` runs in the calling process.
    """
    if workers <= 1:
        for item in items:
            yield fn(item, config)
        return
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_die_with_parent, initargs=(os.getpid(),))
    pending: deque[Future[R]] = deque()
    queue = iter(items)
    try:
        with _ctrl_c_held_while_readers_start():  # the first submits start the readers
            for item in queue:
                pending.append(pool.submit(fn, item, config))
                if len(pending) >= 2 * workers:
                    break
        while pending:
            result = pending.popleft().result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt, config))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- writing


def _example(case_id: str, image: np.ndarray, target: np.ndarray) -> bytes:
    """One case as a serialized ``tf.train.Example`` (written without TensorFlow: :mod:`distmis.data.records`)."""
    return serialize_example({
        "case_id": case_id.encode("utf-8"),
        "image": np.ascontiguousarray(image, dtype="<f4").tobytes(),
        "label": np.ascontiguousarray(target, dtype=np.uint8).tobytes(),
        "image_shape": [int(v) for v in image.shape],
        "label_shape": [int(v) for v in target.shape],
    })


# --------------------------------------------------------------------------- what distmis wrote


def _lock_marker(path: Path) -> int | None:
    """A descriptor holding the exclusive lock of the marker at ``path`` (the caller closes it to release it),
    or None: the marker is missing, not a plain file, held by a live writer, or cannot be locked here."""
    if sys.platform == "win32":  # no flock: a writer's liveness cannot be told, so nothing is taken
        return None
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a plain file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _marker_held(path: Path) -> bool:
    """True when the marker at ``path`` exists and is not free to take (its writer lives, or it cannot be locked)."""
    if not os.path.lexists(path):
        return False
    fd = _lock_marker(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _claim(folder: Path, tag: str) -> int:
    """Write the marker into the fresh ``folder`` and lock it; the lock lasts until the descriptor is closed or
    this process ends, however it ends. The marker's content is written under the lock, so a marker found
    empty may be one whose writer has not locked it yet."""
    fd = os.open(folder / PARTIAL_MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        if sys.platform != "win32":
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a cleaner looks at the still empty marker
        os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "tag": tag}) + "\n").encode())
    except BaseException:
        os.close(fd)
        raise
    _WRITING_HERE.add(f"{os.getpid()}-{tag}")
    return fd


def _release(fd: int, tag: str) -> None:
    """Close the marker's descriptor, which releases its lock (the marker itself is deleted by then)."""
    _WRITING_HERE.discard(f"{os.getpid()}-{tag}")
    os.close(fd)


def _describe(entry: os.DirEntry[str], file: str = "a file the manifest does not list") -> str:
    """``'name' (what it is)`` for an error or a warning; ``file`` says why a plain file is not distmis's."""
    try:
        if entry.is_symlink():
            return f"{entry.name!r} (a symlink to {os.readlink(entry.path)!r})"
        if entry.is_dir(follow_symlinks=False):
            return f"{entry.name + '/'!r} (a folder)"
        if entry.is_file(follow_symlinks=False):
            return f"{entry.name!r} ({file})"
    except OSError:
        pass
    return f"{entry.name!r} (not a plain file)"


def _shown(items: Sequence[str]) -> str:
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _listed_files(manifest: DataManifest) -> set[str]:
    """The shard files a manifest lists (names only; a name with a separator matches no entry of the folder)."""
    try:
        return {str(shard["file"]) for info in manifest.splits.values() for shard in info["shards"]}
    except (AttributeError, KeyError, TypeError):
        return set()


def _delete_own(folder: Path, own: Callable[[str], bool], file: str) -> list[str]:
    """Unlink the plain files (never a symlink, never a folder) of ``folder`` that ``own`` accepts, the manifest
    last (so a kill midway leaves a manifest that lists what is left); the descriptions of the other entries,
    which stay. The marker is neither deleted nor reported."""
    mine: list[Path] = []
    kept: list[str] = []
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name == PARTIAL_MARKER:
                continue
            if entry.is_file(follow_symlinks=False) and own(entry.name):
                mine.append(Path(entry.path))
            else:
                kept.append(_describe(entry, file))
    for path in sorted(mine, key=lambda p: p.name == MANIFEST_NAME):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return kept


def _is_written_file(name: str) -> bool:
    """A file distmis writes in a partial folder: a shard or the manifest."""
    return name == MANIFEST_NAME or _SHARD_FILE.fullmatch(name) is not None


def _discard_partial(folder: Path) -> None:
    """Delete a partial folder whose marker this process holds (or has just locked): its shards and manifest,
    then the marker and the folder. A stranger's file in it stays, with the folder and the marker, and is
    reported."""
    try:
        kept = _delete_own(folder, _is_written_file, "a file distmis does not write there")
        if kept:
            logger.warning("left %s in place: it holds entries distmis did not write (%s); remove them by hand",
                           str(folder), _shown(kept))
            return
        os.unlink(folder / PARTIAL_MARKER)
        os.rmdir(folder)
    except FileNotFoundError:  # gone meanwhile (renamed into place, or removed by another run)
        pass


def _clear_replaced(folder: Path) -> None:
    """Delete what distmis wrote in a folder an overwrite moved aside: the plain files its manifest lists, the
    manifest, a marker nobody holds; then the folder. Anything else stays and is reported."""
    if os.path.islink(folder):  # never followed
        return
    try:
        try:
            listed = _listed_files(read_manifest(folder)) | {MANIFEST_NAME}
        except DataError:  # the manifest was deleted last, or is not one: nothing is provably distmis's
            listed = set()
        kept = _delete_own(folder, listed.__contains__, "a file the manifest does not list")
        if os.path.lexists(folder / PARTIAL_MARKER):
            if _marker_held(folder / PARTIAL_MARKER):
                kept.append(f"{PARTIAL_MARKER!r} (the marker of a conversion still running)")
            else:
                os.unlink(folder / PARTIAL_MARKER)
        if kept:
            logger.warning("kept %s, the folder an overwrite replaced: it holds entries its %s does not list "
                           "(%s); remove them by hand", str(folder), MANIFEST_NAME, _shown(kept))
            return
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the new folder is in place: what could not be cleared stays, and is reported
        logger.warning("could not clear %s, the folder an overwrite replaced: %s", str(folder), exc)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, someone else's
        return False
    return False


def _remove_abandoned_empty(folder: Path, pid: int) -> None:
    """A partial folder with no lockable, written marker (a writer killed between making the folder and
    writing its marker): removed only when it is empty but for an empty marker, its pid is gone, and it has
    not changed for a minute (a writer in another pid namespace is not seen by its pid)."""
    try:
        names = os.listdir(folder)
        if names not in ([], [PARTIAL_MARKER]):
            return
        if names and os.lstat(folder / PARTIAL_MARKER).st_size != 0:
            return
        if time.time() - os.lstat(folder).st_mtime < _ABANDONED_AFTER_S or not _pid_gone(pid):
            return
        if names:
            os.unlink(folder / PARTIAL_MARKER)
        os.rmdir(folder)
    except OSError:
        pass


def _remove_partial(folder: Path, pid: int, tag: str) -> None:
    """Remove the partial folder of a killed conversion; leave one whose writer lives."""
    if f"{pid}-{tag}" in _WRITING_HERE:
        return
    fd = _lock_marker(folder / PARTIAL_MARKER)
    if fd is None:
        _remove_abandoned_empty(folder, pid)
        return
    try:
        if os.fstat(fd).st_size == 0:  # its writer may be about to lock it
            _remove_abandoned_empty(folder, pid)
            return
        _discard_partial(folder)
    finally:
        os.close(fd)


def _settle_aside(folder: Path, out_dir: Path, pid: int, tag: str) -> None:
    """A folder an overwrite moved aside and did not clear (killed). Its writer holds its partial folder's
    marker until the new folder is in place, then the marker in the new folder until the old one is cleared:
    while either is held, it may still run. Otherwise: put the old folder back if nothing took its place,
    else clear it."""
    if f"{pid}-{tag}" in _WRITING_HERE:
        return
    partial = out_dir.parent / f".{out_dir.name}.partial-{pid}-{tag}"
    if _marker_held(partial / PARTIAL_MARKER) or _marker_held(out_dir / PARTIAL_MARKER):
        return
    if not os.path.lexists(out_dir):
        try:
            os.replace(folder, out_dir)
        except OSError:
            return
        logger.warning("restored %s from %s, where an interrupted overwrite had moved it", str(out_dir), str(folder))
        return
    _clear_replaced(folder)


def remove_leftovers(out_dir: str | Path) -> None:
    """Remove what killed conversions left beside ``out_dir``.

    * Partial folders (``.{name}.partial-{pid}-{tag}``) in ``out_dir``'s parent whose marker
      (:data:`PARTIAL_MARKER`) no live process holds: their shards and manifest, then the marker and the folder.
      A folder whose writer still runs is never touched; nor is a file distmis does not write there (it stays,
      with a warning naming it).
    * A folder an interrupted overwrite of ``out_dir`` moved aside (``.{name}.old-{pid}-{tag}``): put back when
      ``out_dir`` is missing, else cleared of the files its manifest lists.

    Called by :func:`convert_to_tfrecords` before it writes; nothing is raised (what cannot be removed stays).
    """
    out_dir = Path(out_dir)
    aside = re.compile(rf"\.{re.escape(out_dir.name)}\.old-(?P<pid>\d+)-(?P<tag>[0-9a-f]{{8}})")
    try:
        with os.scandir(out_dir.parent) as scan:
            entries = [e for e in scan if e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:  # no parent yet, or not readable: nothing to remove
        return
    for entry in entries:
        match = aside.fullmatch(entry.name)
        if match:
            _settle_aside(Path(entry.path), out_dir, int(match["pid"]), match["tag"])
    for entry in entries:
        match = _PARTIAL.fullmatch(entry.name)
        if match:
            _remove_partial(Path(entry.path), int(match["pid"]), match["tag"])


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an existing ``out_dir`` unless ``overwrite``, and then unless it holds only what distmis wrote:
    the manifest and the plain files it lists (and a marker nobody holds). Nothing is deleted here."""
    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise DataError(f"output folder {str(out_dir)!r} already exists; pass overwrite=True (CLI: --overwrite) "
                        "to replace it")
    if out_dir.is_symlink():
        raise DataError(f"output path {str(out_dir)!r} is a symlink (to {os.readlink(out_dir)!r}): overwrite "
                        "replaces only a folder distmis wrote, never a link or what it points to; pass the folder "
                        "itself, or choose another path")
    if not out_dir.is_dir():
        raise DataError(f"output path {str(out_dir)!r} exists and is not a folder; refusing to replace it")
    with os.scandir(out_dir) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    if not entries:
        return
    try:
        manifest = read_manifest(out_dir)
    except DataError as exc:
        raise DataError(f"output folder {str(out_dir)!r} is not empty and is not a TFRecord folder distmis wrote "
                        f"({exc}), so overwrite will not replace it; choose another folder") from None
    listed = _listed_files(manifest) | {MANIFEST_NAME}
    foreign: list[str] = []
    for entry in entries:
        if entry.name == PARTIAL_MARKER and entry.is_file(follow_symlinks=False):
            if _marker_held(Path(entry.path)):
                foreign.append(f"{entry.name!r} (the marker of a conversion still running)")
        elif entry.name in listed and entry.is_file(follow_symlinks=False):
            continue
        elif entry.name in listed and entry.is_symlink():
            foreign.append(f"{entry.name!r} (a symlink to {os.readlink(entry.path)!r}, where distmis wrote a "
                           "plain file)")
        else:
            foreign.append(_describe(entry))
    if foreign:
        raise DataError(f"output folder {str(out_dir)!r} holds entries that are not plain files its "
                        f"{MANIFEST_NAME} lists: {_shown(foreign)}. Overwrite replaces only what distmis wrote (the "
                        f"plain files the manifest lists, and the manifest), so it deletes nothing here; move these "
                        "or choose another folder")


def _plan(cases: Sequence[CaseFiles], split: Mapping[str, Any]) -> dict[str, list[CaseFiles]]:
    """Cases of each part of the split (:func:`~distmis.data.split.split_parts`: train, val, test, or fold0 ...
    and test), parts and cases in the split's order; DataError for unknown or duplicated ids."""
    validate_split(split)
    by_id: dict[str, CaseFiles] = {}
    for case in cases:
        if case.case_id in by_id:
            raise DataError(f"case id {case.case_id!r} appears twice in the list of cases")
        by_id[case.case_id] = case
    parts = split_parts(split)
    unknown = [c for ids in parts.values() for c in ids if c not in by_id]
    if unknown:
        raise DataError(
            f"the split names {len(unknown)} case(s) that are not in the data set, e.g. {unknown[:5]}; "
            f"was the split made for another data set?"
        )
    plan = {name: [by_id[c] for c in ids] for name, ids in parts.items()}
    if not any(plan.values()):
        raise DataError(f"the split has no cases in {', '.join(plan)}; nothing to convert")
    return plan


def convert_to_tfrecords(
    cases: Sequence[CaseFiles],
    split: Mapping[str, Any],
    config: PreprocessConfig,
    out_dir: str | Path,
    *,
    shards_per_split: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    description: Any = None,
) -> DataManifest:
    """Read, preprocess and write the cases of ``split`` as sharded TFRecords.

    Args:
        cases: the data set's cases (from :func:`~distmis.data.layouts.discover_cases`).
        split: a split dict (:func:`~distmis.data.split.make_split`, with or without folds): one shard set per
            part (:func:`~distmis.data.split.split_parts`); cases in no part are skipped.
        config: preprocessing; after it, every case must have the same shape.
        out_dir: output folder, created atomically (see the module docstring).
        shards_per_split: shards per split; default: ~8 cases per shard.
            Always clamped to ``[1, number of cases in the split]``.
        workers: reader processes; default :func:`default_readers` (``min(cpu count, 4)``, in-process for a small
            data set); 1 = in-process.
        progress: show the progress on stderr (:mod:`~distmis.data.case_progress`).
        description: the data set's :class:`~distmis.data.description.DatasetDescription` (its channels and
            labels); None: the layout's own (the BraTS layouts, MSD Task01).
        overwrite: replace an existing TFRecord folder at ``out_dir``: an
            empty folder, or one that holds only its manifest and the plain
            files the manifest lists (all that is deleted). Anything else in
            it (an unlisted file or folder, a symlink) is refused, by name.

    Returns:
        the manifest (also written to ``out_dir/manifest.json``).

    Raises:
        DataError: naming the file or case, for unreadable files, mismatched
            shapes, bad label values, cases with different shapes after
            preprocessing, or an existing ``out_dir``; naming the folder, for a
            disk without room for the records (checked from the headers before
            anything is read: :mod:`~distmis.data.disk_space`, or met while
            writing) or a folder that cannot be written in.  Nothing is left on
            disk when it fails.

    Leftovers of killed conversions beside ``out_dir`` are removed first
    (:func:`remove_leftovers`).
    """
    out_dir = Path(out_dir)
    if shards_per_split is not None and int(shards_per_split) < 1:
        raise ValueError(f"shards_per_split must be >= 1, got {shards_per_split!r}")
    remove_leftovers(out_dir)
    _check_out_dir(out_dir, overwrite)
    plan = _plan(cases, split)
    ordered = [case for part in plan.values() for case in part]
    room = check_room(ordered, config, out_dir.parent)  # before anything is read or written
    if workers is None:
        workers = default_readers(ordered, room.needed)
    workers = max(1, min(int(workers), len(ordered)))

    tag = uuid.uuid4().hex[:8]
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{tag}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise _unwritable(room, exc) from None
    except BaseException:  # a Ctrl-C the moment the folder was made: still empty, and not marked as distmis's yet
        if tmp.is_dir():
            tmp.rmdir()
        raise
    try:
        marker = _claim(tmp, tag)
    except BaseException as exc:
        if os.path.lexists(tmp / PARTIAL_MARKER):  # made, but not written in full (a full disk)
            os.unlink(tmp / PARTIAL_MARKER)
        os.rmdir(tmp)
        raise _unwritable(room, exc) if isinstance(exc, OSError) else exc
    try:
        results = _ordered_map(_load_case, ordered, (config, description), workers)
        bar = CaseProgress(len(ordered), "tfrecords", enabled=progress)
        try:
            image_shape: tuple[int, ...] | None = None
            label_shape: tuple[int, ...] | None = None
            first_case = ""
            splits_info: dict[str, Any] = {}
            for name in plan:
                sizes = _shard_sizes(len(plan[name]), shards_per_split)
                shards = []
                for index, size in enumerate(sizes):
                    filename = shard_name(name, index, len(sizes))
                    with open(tmp / filename, "wb") as writer:
                        for _ in range(size):
                            case_id, image, target = next(results)
                            if image_shape is None:
                                image_shape, label_shape, first_case = image.shape, target.shape, case_id
                            elif image.shape != image_shape or target.shape != label_shape:
                                raise DataError(
                                    f"case {case_id!r} has image shape {image.shape} / label shape {target.shape} "
                                    f"after preprocessing, but case {first_case!r} has {image_shape} / {label_shape}; "
                                    f"all cases must have one shape: set crop or resize in the PreprocessConfig "
                                    f"(spec: dataset.crop / dataset.resize; CLI: --crop / --resize)"
                                )
                            write_record(writer, _example(case_id, image, target))
                            bar.update(1)
                    shards.append({"file": filename, "num_cases": size, "sha256": _sha256(tmp / filename)})
                splits_info[name] = {
                    "num_cases": len(plan[name]),
                    "case_ids": [c.case_id for c in plan[name]],
                    "shards": shards,
                }
            assert image_shape is not None and label_shape is not None
            written = DataManifest(
                preprocess=config.to_dict(), image_shape=tuple(image_shape), label_shape=tuple(label_shape),
                splits=splits_info, num_classes=config.num_classes, channels=tuple(config.channels or MODALITIES),
                targets=config.scheme, dataset=description.to_dict() if description is not None else None,
                split=json.loads(json.dumps(dict(split))),
            )
            (tmp / MANIFEST_NAME).write_text(json.dumps(written.to_dict(), indent=2) + "\n")
        finally:
            results.close()  # stops the worker pool
            bar.close()
        _move_into_place(tmp, out_dir, tag)
    except BaseException as exc:
        _discard_partial(tmp)
        if is_disk_full(exc):  # the writer's or another: one clear error, nothing half-written left
            raise full_disk_error(room, exc) from None
        raise
    finally:
        _release(marker, tag)
    return written


def _unwritable(room: Room, exc: OSError) -> DataError:
    """The DataError of an output folder that cannot be made or written in (read-only, no permission, full)."""
    if is_disk_full(exc):
        return full_disk_error(room, exc)
    return DataError(f"cannot write the TFRecords in {str(room.folder)!r}: {exc.strerror or exc} "
                     f"({str(exc.filename or room.folder)!r}); choose an output folder this user can write in")


def _move_into_place(tmp: Path, out_dir: Path, tag: str) -> None:
    """Rename the finished folder ``tmp`` (its marker locked by this process) to ``out_dir``.

    A folder already at ``out_dir`` is checked again (:func:`_check_out_dir`: something may have appeared
    while converting), moved aside to ``.{name}.old-{pid}-{tag}`` and, once the new folder is in place, cleared
    of the files its manifest lists. The marker is deleted last: a kill at any point leaves a state that
    :func:`remove_leftovers` settles on the next run.
    """
    aside: Path | None = None
    if os.path.lexists(out_dir):
        _check_out_dir(out_dir, True)
        aside = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{tag}"
        os.replace(out_dir, aside)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if aside is not None:
            os.replace(aside, out_dir)
        raise
    if aside is not None:
        _clear_replaced(aside)
    try:
        os.unlink(out_dir / PARTIAL_MARKER)
    except OSError as exc:  # pragma: no cover - the folder was just made by this process
        logger.warning("could not delete %s: %s", str(out_dir / PARTIAL_MARKER), exc)


# --------------------------------------------------------------------------- reading


def _split_shards(tfrecord_dir: Path, manifest: DataManifest,
                  split: str | Sequence[str]) -> tuple[list[Path], int]:
    """Shard paths and number of cases of ``split``: one part, or the union of several (their shards in the
    order of the parts); DataError if a part is unknown, they hold no case, or a shard is missing (ValueError
    for no part or one named twice)."""
    splits = manifest.splits
    parts = part_names(split)
    paths: list[Path] = []
    num_cases = 0
    for part in parts:
        if part not in splits:
            raise DataError(f"split {part!r} is not in {str(tfrecord_dir)!r}; available: {sorted(splits)}")
        info = splits[part]
        paths += [tfrecord_dir / shard["file"] for shard in info["shards"]]
        num_cases += int(info["num_cases"])
    if num_cases == 0:
        named = f"split {parts[0]!r}" if len(parts) == 1 else f"splits {list(parts)}"
        raise DataError(f"{named} of {str(tfrecord_dir)!r} {'has' if len(parts) == 1 else 'have'} no cases")
    for path in paths:
        if not path.is_file():
            raise DataError(f"shard {str(path)!r} listed in the manifest does not exist")
    return paths, num_cases


def verify_checksums(tfrecord_dir: str | Path) -> None:
    """Check every shard against the sha256 recorded in the manifest.

    Raises:
        DataError: naming the first shard that is missing or whose checksum differs.
    """
    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    for info in manifest.splits.values():
        for shard in info["shards"]:
            path = tfrecord_dir / shard["file"]
            if not path.is_file():
                raise DataError(f"shard {str(path)!r} listed in the manifest does not exist")
            actual = _sha256(path)
            if actual != shard["sha256"]:
                raise DataError(
                    f"shard {str(path)!r} is corrupt or was modified: sha256 {actual} != {shard['sha256']} in the manifest"
                )


def _check_tile(tile: Sequence[int], spatial: Sequence[int], tfrecord_dir: Path) -> tuple[int, int, int]:
    try:
        values = tuple(int(t) for t in tile)
    except (TypeError, ValueError):
        raise ValueError(f"tile must be 3 positive integers, got {tile!r}") from None
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"tile must be 3 positive integers, got {tile!r}")
    if any(t > s for t, s in zip(values, spatial)):
        raise ValueError(
            f"tile {values} is larger than the volumes {tuple(spatial)} stored in {str(tfrecord_dir)!r}; "
            f"use a tile no larger than the volume on every axis"
        )
    return values  # type: ignore[return-value]


def make_dataset(
    tfrecord_dir: str | Path,
    split: str | Sequence[str],
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    tile: Sequence[int] | None = None,
    cache: bool = True,
    drop_remainder: bool = False,
    shard: tuple[int, int] | None = None,
    repeat: bool = False,
    tile_sampling: float = 0.0,
    augment: AugmentSpec | None = None,
) -> tf.data.Dataset:
    """tf.data pipeline of ``(image, label)`` batches for one split, or the union of several.

    shards -> interleave(TFRecordDataset) -> parse + reshape -> [shard] ->
    cache -> shuffle (buffer = all cases, reshuffled each epoch) -> [repeat] ->
    random tile crop (same offset for image and label) -> [augment] -> batch -> prefetch.

    The element order and the tiles are a deterministic function of ``seed``
    (and of the epoch, when the same dataset object is iterated again).

    Args:
        split: a part of the folder (``"train"``, ``"fold0"``, ...), or several (``["fold0", "fold2"]``): their
            shards are read as one set (interleaved, shuffled and sharded together).
        shard: ``(num_shards, index)`` keeps every ``num_shards``-th case
            starting at ``index`` (one data-parallel worker's part).
        repeat: make the dataset endless (take a fixed number of batches per epoch).
        tile_sampling: the fraction of tiles centred on a foreground voxel (any label channel but a one-hot's
            background: any class), drawn at random; the others at a uniform random offset
            (``training.tile_sampling``).
        augment: ``training.augment``: random transforms of each element after its tile is cut
            (:mod:`distmis.data.augment_tf`; training pipelines only), seeded by ``seed`` and the epoch.

    Returns:
        a dataset of ``image`` float32 ``(B, h, w, d, 4)`` and ``label`` float32
        ``(B, h, w, d, C)``, where ``(h, w, d)`` is ``tile`` if given.
    """
    tfrecord_dir = Path(tfrecord_dir)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    manifest = read_manifest(tfrecord_dir)
    paths, num_cases = _split_shards(tfrecord_dir, manifest, split)
    image_shape = [int(s) for s in manifest.image_shape]
    label_shape = [int(s) for s in manifest.label_shape]
    tile3 = _check_tile(tile, image_shape[:3], tfrecord_dir) if tile is not None else None
    if shard is not None:
        num_shards, index = (int(v) for v in shard)
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard must be (num_shards >= 1, index in [0, num_shards)), got {tuple(shard)!r}")
        num_cases = max(1, len(range(index, num_cases, num_shards)))

    tf = _tf()
    autotune = tf.data.AUTOTUNE
    files = tf.data.Dataset.from_tensor_slices([str(p) for p in paths])
    ds = files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(paths), INTERLEAVE_CYCLE),
        block_length=1,
        num_parallel_calls=autotune,
        deterministic=True,
    )
    ds = ds.map(_parser(tf, image_shape, label_shape), num_parallel_calls=autotune, deterministic=True)
    if shard is not None:
        ds = ds.shard(num_shards, index)
    if cache:
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(num_cases, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    augmenting = augment is not None and augment.active
    if tile3 is None and not augmenting:
        ds = ds.map(lambda image, label: (image, tf.cast(label, tf.float32)), num_parallel_calls=autotune,
                    deterministic=True)
    else:  # each element drawn a random integer, re-drawn each epoch: its tile's and its transforms' seed
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)))
        if tile3 is not None:
            from distmis.data.targets import manifest_targets

            first = 1 if manifest_targets(manifest)["activation"] == "softmax" else 0  # a one-hot's background
            crop = _tiler(tf, tile3, image_shape, label_shape, seed, tile_sampling, first_foreground=first)
            ds = ds.map(lambda pair, draw: (crop(pair, draw), draw), num_parallel_calls=autotune, deterministic=True)
        ds = ds.map(lambda pair, draw: (pair[0], tf.cast(pair[1], tf.float32), draw), num_parallel_calls=autotune,
                    deterministic=True)
        if augmenting:
            from distmis.data.augment_tf import augmenter

            spatial = tile3 if tile3 is not None else tuple(image_shape[:3])
            ds = ds.map(augmenter(tf, augment, spatial, seed), num_parallel_calls=autotune, deterministic=True)
        else:
            ds = ds.map(lambda image, label, draw: (image, label), num_parallel_calls=autotune, deterministic=True)
    ds = ds.batch(int(batch_size), drop_remainder=drop_remainder)
    return ds.prefetch(autotune).with_options(_fixed_parallelism(tf))


def _fixed_parallelism(tf: Any) -> Any:
    """The pipeline's options: no autotuning thread. Its ``AUTOTUNE`` parallelism and buffers are then fixed at
    the process's thread pool (a trial's pinned threads: :func:`~distmis.train.threads.pin_threads`).

    An iterator's destructor joins its autotuning thread, which waits out its optimization period first (TensorFlow
    2.20): each epoch's iterator, dropped at the epoch's end, held a trial of one CPU idle for 2 to 17 s, in 7 of
    the 12 epochs of four 3-epoch trials on one Tune actor (benchmarks/history.md). A trial of one or two CPUs has
    no parallelism for it to tune."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def _parser(tf: Any, image_shape: list[int], label_shape: list[int]) -> Callable[[Any], tuple[Any, Any]]:
    features = {
        "case_id": tf.io.FixedLenFeature([], tf.string),
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.string),
        "image_shape": tf.io.FixedLenFeature([len(image_shape)], tf.int64),
        "label_shape": tf.io.FixedLenFeature([len(label_shape)], tf.int64),
    }

    def parse(record: Any) -> tuple[Any, Any]:
        example = tf.io.parse_single_example(record, features)
        checks = [
            tf.debugging.assert_equal(example["image_shape"], tf.constant(image_shape, tf.int64), message="image_shape differs from the manifest"),
            tf.debugging.assert_equal(example["label_shape"], tf.constant(label_shape, tf.int64), message="label_shape differs from the manifest"),
        ]
        with tf.control_dependencies(checks):
            image = tf.reshape(tf.io.decode_raw(example["image"], tf.float32, little_endian=True), image_shape)
            label = tf.reshape(tf.io.decode_raw(example["label"], tf.uint8), label_shape)
        return tf.ensure_shape(image, image_shape), tf.ensure_shape(label, label_shape)

    return parse


def _tiler(
    tf: Any, tile: tuple[int, int, int], image_shape: list[int], label_shape: list[int], seed: int,
    tile_sampling: float = 0.0, first_foreground: int = 0,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Random crop of ``tile`` at one offset for image and label, from a per-element random int: a uniform
    offset, or with probability ``tile_sampling`` the tile centred on a random foreground voxel (a voxel of any
    label channel from ``first_foreground`` on: 1 skips a one-hot's background; moved inside the volume where it
    would stick out; a case without foreground keeps its uniform offset). The foreground draws come from a stream
    of their own, so the uniform offsets are those of ``tile_sampling`` 0."""
    max_offset = tf.constant([s - t for s, t in zip(image_shape[:3], tile)], tf.float32)
    half = tf.constant([t // 2 for t in tile], tf.int32)
    if not 0.0 <= tile_sampling <= 1.0:
        raise ValueError(f"tile_sampling must lie in [0, 1], got {tile_sampling}")

    def crop(pair: Any, draw: Any) -> tuple[Any, Any]:
        image, label = pair
        u = tf.random.stateless_uniform([3], seed=tf.stack([tf.constant(seed, tf.int64), draw]), dtype=tf.float32)
        offset = uniform = tf.cast(tf.minimum(tf.floor(u * (max_offset + 1.0)), max_offset), tf.int32)
        if tile_sampling > 0:
            coin, pick = tf.unstack(tf.random.stateless_uniform(
                [2], seed=tf.stack([tf.constant(seed, tf.int64) + 1, draw]), dtype=tf.float32))
            held = label[..., first_foreground:]
            foreground = tf.cast(tf.where(tf.reduce_any(held > 0, axis=-1)), tf.int32)  # (N, 3) voxels
            count = tf.shape(foreground)[0]

            def centred() -> Any:
                centre = foreground[tf.minimum(tf.cast(pick * tf.cast(count, tf.float32), tf.int32), count - 1)]
                return tf.clip_by_value(centre - half, 0, tf.cast(max_offset, tf.int32))

            offset = tf.cond(tf.logical_and(coin < tile_sampling, count > 0), centred, lambda: uniform)
        begin = tf.concat([offset, [0]], axis=0)
        image = tf.slice(image, begin, list(tile) + [image_shape[3]])
        label = tf.slice(label, begin, list(tile) + [label_shape[3]])
        return tf.ensure_shape(image, list(tile) + [image_shape[3]]), tf.ensure_shape(label, list(tile) + [label_shape[3]])

    return crop


def iter_cases(tfrecord_dir: str | Path,
               split: str | Sequence[str]) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield ``(case_id, image, label)`` of ``split`` (one part, or several: one after the other, in the order
    given) in stored order, as numpy arrays.

    ``image`` is float32 ``(h, w, d, 4)`` and ``label`` uint8 ``(h, w, d, C)``,
    bit-identical to what :func:`~distmis.data.preprocess.preprocess_case`
    produced.  Meant for whole-volume validation and inspection, and the torch
    trainers' input: it reads the files without TensorFlow (:mod:`distmis.data.records`).
    """
    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    paths, _ = _split_shards(tfrecord_dir, manifest, split)
    image_shape = tuple(int(s) for s in manifest.image_shape)
    label_shape = tuple(int(s) for s in manifest.label_shape)
    for path in paths:
        for record in read_records(path):  # no TensorFlow: torch trials read their cases with this
            feature = parse_example(record)
            case_id = bytes(feature["case_id"]).decode("utf-8")  # type: ignore[arg-type]
            if tuple(feature["image_shape"]) != image_shape or tuple(feature["label_shape"]) != label_shape:
                raise DataError(f"shard {str(path)!r}: case {case_id!r} has shapes that differ from the manifest")
            image = np.frombuffer(feature["image"], dtype="<f4").astype(np.float32).reshape(image_shape)  # type: ignore[arg-type]
            label = np.frombuffer(feature["label"], dtype=np.uint8).copy().reshape(label_shape)  # type: ignore[arg-type]
            yield case_id, image, label
