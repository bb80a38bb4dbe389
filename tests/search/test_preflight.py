"""The output folder's check before any work (issue 46, finding 6): a folder that cannot be written in is refused,
named, whatever the tracking store. A read-only mount where the test may mount one (root writes through permission
bits), permission bits for another user (tests/mounts.py). The real ``distmis run``: tests/faults/test_full_disk.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distmis.search.preflight import OutputUnwritable, check_output_writable
from distmis.search.state import SearchStateError
from tests.mounts import tmpfs, unwritable_folder


def test_a_read_only_output_folder_is_refused_naming_it(tmp_path: Path):
    with unwritable_folder(tmp_path / "ro") as (disk, reason):
        with pytest.raises(OutputUnwritable, match=rf"the output folder '{disk}' cannot be written in: "
                                                   rf"{reason}\. Nothing was started"):
            check_output_writable(disk)
        nested = disk / "runs" / "tiny"  # not there yet: where it would be made is tried
        with pytest.raises(OutputUnwritable, match=rf"'{nested}' cannot be written in \(it would be made in "
                                                   rf"'{disk}'\): {reason}"):
            check_output_writable(nested)
    assert issubclass(OutputUnwritable, SearchStateError)  # the CLI's exit 2


def test_a_full_disk_is_refused_too(tmp_path: Path):
    with tmpfs(tmp_path / "full", size="64k") as disk:
        (disk / "filler").write_bytes(b"\0" * 64 * 1024)
        with pytest.raises(OutputUnwritable, match="No space left on device"):
            check_output_writable(disk / "out")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # no probe left behind


def test_a_file_in_the_way_is_refused_and_a_writable_folder_is_left_as_it_was(tmp_path: Path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(OutputUnwritable, match=rf"cannot be made: '{tmp_path / 'a-file'}' is not a folder"):
        check_output_writable(tmp_path / "a-file" / "out")
    check_output_writable(tmp_path / "out")
    check_output_writable(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing made, nothing left
