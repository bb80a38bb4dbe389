"""Room on disk for a TFRecord conversion (issue 46, finding 6): the records' size estimated from the headers, a
disk without room for them refused before anything is read or written, and a full disk told from other errors.
A disk that fills up while the records are written, with a real ``distmis`` process: tests/faults/test_full_disk.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from distmis.data import DataError, PreprocessConfig, convert_to_tfrecords, discover_cases, make_split
from distmis.data.disk_space import Room, check_room, full_disk_error, is_disk_full, size_text, tfrecord_bytes
from tests.mounts import tmpfs


def _split(cases):
    return make_split([c.case_id for c in cases], train=0.5, val=0.25, test=0.25, seed=0)


def _written(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


@pytest.mark.parametrize("config", [PreprocessConfig(layout="msd", resize=(10, 12, 14)),
                                    PreprocessConfig(layout="msd", spacing=(2.0, 1.5, 1.0))],
                         ids=["resized", "resampled-from-the-headers"])
def test_the_estimate_covers_what_the_conversion_writes_closely(msd_root: Path, tmp_path: Path,
                                                                config: PreprocessConfig):
    cases = discover_cases(msd_root, "msd")
    out = tmp_path / "tfr"
    convert_to_tfrecords(cases, _split(cases), config, out, workers=1, progress=False)
    estimate, written = tfrecord_bytes(cases, config), _written(out)
    assert written <= estimate <= 1.1 * written, (estimate, written)


def test_a_disk_without_room_is_refused_before_anything_is_read_or_written(msd_root: Path, tmp_path: Path):
    cases = discover_cases(msd_root, "msd")  # 4 cases of 16^3 voxels: about 276 KiB of records
    config = PreprocessConfig(layout="msd")
    needed = tfrecord_bytes(cases, config)
    with tmpfs(tmp_path / "small", size="128k") as disk:
        with pytest.raises(DataError) as raised:
            convert_to_tfrecords(cases, _split(cases), config, disk / "tfr", workers=1, progress=False)
        message = str(raised.value)
        assert f"not enough free space for the TFRecords in {str(disk)!r}" in message
        assert f"about {size_text(needed)}" in message and "128.0 KiB free" in message
        assert "Nothing was written" in message
        assert list(disk.iterdir()) == []
    room = check_room(cases, config, tmp_path / "not" / "made" / "yet")  # the nearest existing folder's disk
    assert room.needed == needed and room.free is not None and room.free > needed


def test_records_larger_than_the_disk_are_refused_there_without_a_mount(msd_root: Path, tmp_path: Path):
    """The same refusal on the test's own disk: resized to 2^15 voxels a side, 4 cases need about 2.2 PiB."""
    cases = discover_cases(msd_root, "msd")
    config = PreprocessConfig(layout="msd", resize=(2**15, 2**15, 2**15))
    needed = tfrecord_bytes(cases, config)
    out = tmp_path / "records" / "tfr"
    with pytest.raises(DataError) as raised:
        convert_to_tfrecords(cases, _split(cases), config, out, workers=1, progress=False)
    message = str(raised.value)
    assert f"not enough free space for the TFRecords in {str(out.parent)!r}" in message
    assert f"about {size_text(needed)}" in message and "Nothing was written" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the output's parent folder made


def test_a_full_disk_is_told_from_other_errors():
    import tensorflow as tf

    assert is_disk_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/train-00000-of-00001.tfrecord"))
    assert is_disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    assert not is_disk_full(OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert not is_disk_full(ValueError("No space left on device"))
    # TensorFlow's writer says it with its own error, the system's reason at the end of the message
    assert is_disk_full(tf.errors.ResourceExhaustedError(None, None, "/x/a.tfrecord; No space left on device"))
    assert not is_disk_full(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"))
    quota = tf.errors.ResourceExhaustedError(None, None, "/x/a.tfrecord; Disk quota exceeded")
    message = str(full_disk_error(Room(Path("/x"), 3 * 2**20, 2**20), quota))
    assert message.startswith("the disk holding '/x' is full (Disk quota exceeded)")
    assert "they need about 3.0 MiB; 1.0 MiB was free when the conversion started" in message
