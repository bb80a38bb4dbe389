"""The search's Ray storage writes whole files: a writer killed mid-file leaves the old file, never a part of the new
(the CI failure of issue 36: a driver SIGKILLed while Tune copied its searcher state left it empty, and ``--resume``
failed on ``EOFError``)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from distmis.trial.storage import PARTIAL_MARK, atomic_local_filesystem

KILLED_WRITER = """
import os, signal, sys
from distmis.trial.storage import atomic_local_filesystem
stream = atomic_local_filesystem().open_output_stream(sys.argv[1])
stream.write(b"new state, first half ")
stream.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_file_leaves_the_old_file_whole(tmp_path: Path) -> None:
    state = tmp_path / "search_gen_state-1.json"
    state.write_bytes(b"old state, whole")
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(state)], capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert state.read_bytes() == b"old state, whole"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != state.name]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{state.name}{PARTIAL_MARK}")
    assert not leftovers[0].endswith((".json", ".pkl"))  # Tune's restore reads those names only


def test_a_closed_stream_replaces_the_file_with_the_same_mode_as_a_plain_write(tmp_path: Path) -> None:
    fs = atomic_local_filesystem()
    plain = tmp_path / "plain.json"
    plain.write_bytes(b"x")
    with fs.open_output_stream(str(tmp_path / "deep" / "state.json")) as stream:
        stream.write(b"new state")
    written = tmp_path / "deep" / "state.json"
    assert written.read_bytes() == b"new state"
    assert os.stat(written).st_mode == os.stat(plain).st_mode
    assert sorted(p.name for p in written.parent.iterdir()) == ["state.json"]


def test_copy_files_into_it_like_tune_writes_every_file(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "trial_1").mkdir(parents=True)
    (staging / "experiment_state-1.json").write_text("{}")
    (staging / "trial_1" / "result.json").write_bytes(os.urandom(5_000_000))
    pafs.copy_files(str(staging), str(tmp_path / "storage"), destination_filesystem=atomic_local_filesystem())
    for source in staging.rglob("*"):
        copy = tmp_path / "storage" / source.relative_to(staging)
        assert copy.is_dir() if source.is_dir() else copy.read_bytes() == source.read_bytes()


FULL_DISK_WRITER = """
import resource, signal, sys
from distmis.trial.storage import atomic_local_filesystem
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # writes past 1000 bytes fail, as on a full disk
stream = atomic_local_filesystem().open_output_stream(sys.argv[1])
try:
    stream.write(b"n" * 5000)
except OSError as error:
    print("write failed:", error.errno)
stream.close()
"""


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_bytes(b"old")
    writer = subprocess.run([sys.executable, "-c", FULL_DISK_WRITER, str(state)], capture_output=True, text=True)
    assert writer.returncode == 0, writer.stderr
    assert "write failed" in writer.stdout
    assert state.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_trials_receive_the_same_file_system_pickled() -> None:
    fs = atomic_local_filesystem()
    again = pickle.loads(pickle.dumps(fs))
    assert again.equals(fs) and again.type_name == fs.type_name
    with pytest.raises(OSError, match="root"):
        fs.delete_dir_contents("/", accept_root_dir=True)
