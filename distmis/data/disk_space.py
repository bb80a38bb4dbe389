"""Room on disk for a TFRecord conversion: what its records will take, checked against the free space before
anything is read or written, and a disk that fills up while they are written told as such.

:func:`check_room` estimates the records' size from the NIfTI headers alone (each case's preprocessed shape:
:func:`~distmis.data.preprocess.preprocessed_shape`; float32 per image channel and a byte per target channel, plus
each record's framing) and raises :class:`~distmis.data.errors.DataError` when the disk holding the output folder
has less free space than that. The estimate is close but not exact (a file system rounds files up to its blocks,
and another process may write meanwhile), so a full disk can still be met while writing: :func:`is_disk_full`
tells it from the exception (Python's ``OSError`` or TensorFlow's ``ResourceExhaustedError``), and
:func:`full_disk_error` says which folder, that its disk is full, and how much the records need.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distmis.data.errors import DataError
from distmis.data.layouts import MODALITIES, CaseFiles, case_orientation, case_spacing, case_spatial_shape
from distmis.data.preprocess import PreprocessConfig, preprocessed_shape

__all__ = ["Room", "check_room", "full_disk_error", "is_disk_full", "tfrecord_bytes"]

#: ``errno`` values of a full disk: no space left, or the user's quota spent.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Bytes a record takes besides its voxels: TFRecord framing, the Example's feature names, case id and shapes,
#: and the case's entry in the manifest (generous: a few hundred bytes are measured).
RECORD_OVERHEAD = 1024


@dataclass(frozen=True)
class Room:
    """What a conversion into ``folder`` needs and what its disk had free when it started (None: not known)."""

    folder: Path
    needed: int | None
    free: int | None


def size_text(count: float) -> str:
    """``1.5 MiB``: a byte count for a person."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{int(count)} bytes" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def tfrecord_bytes(cases: Sequence[CaseFiles], config: PreprocessConfig) -> int:
    """About what the TFRecords of ``cases`` take on disk, from their headers only (none read when
    ``config.crop`` or ``config.resize`` fixes the shape). Raises DataError when a header cannot be read."""
    per_voxel = 4 * len(config.channels or MODALITIES) + config.num_classes  # float32 image, uint8 targets
    fixed = config.resize or config.crop
    total = 0
    for case in cases:
        if fixed is not None:
            shape: Sequence[int] = fixed
        else:
            shape = preprocessed_shape(
                case_spatial_shape(case), config,
                spacing=case_spacing(case) if config.spacing is not None else None,
                axcodes=case_orientation(case) if config.orientation is not None else None)
        total += math.prod(shape) * per_voxel + RECORD_OVERHEAD
    return total


def free_bytes(folder: str | Path) -> int | None:
    """The space free to this user on the disk that holds ``folder`` (or would: its nearest existing parent)."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def check_room(cases: Sequence[CaseFiles], config: PreprocessConfig, folder: str | Path) -> Room:
    """The room a conversion of ``cases`` into ``folder`` needs; DataError, naming the folder, the space needed and
    the space free, when its disk has less free space than that. When the size cannot be estimated (a header that
    cannot be read: the conversion reports it, naming the file) nothing is refused."""
    folder = Path(folder)
    try:
        needed: int | None = tfrecord_bytes(cases, config)
    except (DataError, ValueError):
        needed = None
    room = Room(folder, needed, free_bytes(folder))
    if room.needed is not None and room.free is not None and room.needed > room.free:
        raise DataError(
            f"not enough free space for the TFRecords in {str(folder)!r}: its {len(cases)} cases need about "
            f"{size_text(room.needed)}, and the disk holding it has {size_text(room.free)} free. Nothing was "
            "written: free some space, or choose an output folder on another disk")
    return room


def _full_disk_reason(exc: BaseException) -> str | None:
    """The system's words for a full disk in ``exc`` (``No space left on device``, ``Disk quota exceeded``), or None
    when it is not about one: an ``OSError`` with ENOSPC or EDQUOT, or TensorFlow's error for one (a
    ``ResourceExhaustedError`` whose message ends in the system's reason)."""
    if isinstance(exc, OSError):
        return os.strerror(exc.errno) if exc.errno in FULL_DISK_ERRNOS else None
    if type(exc).__name__ != "ResourceExhaustedError":
        return None
    message = str(exc)
    return next((os.strerror(code) for code in sorted(FULL_DISK_ERRNOS) if os.strerror(code) in message), None)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota) is full."""
    return _full_disk_reason(exc) is not None


def full_disk_error(room: Room, exc: BaseException) -> DataError:
    """The DataError of a disk found full while writing into ``room.folder``: the folder, that its disk is full,
    what the records need and what was free at the start. The caller has removed what it wrote by then."""
    needed = f"about {size_text(room.needed)}" if room.needed is not None else "an amount not known beforehand"
    free = f"; {size_text(room.free)} was free when the conversion started" if room.free is not None else ""
    reason = _full_disk_reason(exc) or os.strerror(errno.ENOSPC)
    return DataError(
        f"the disk holding {str(room.folder)!r} is full ({reason}) while writing the TFRecords: they need {needed}"
        f"{free}. What was written has been removed: free some space, or choose an output folder on another disk")
