"""Disks a search cannot write to, with real ``distmis`` processes and small tmpfs mounts (issue 46, finding 6).

* A disk that fills up while ``distmis data tfrecord`` writes (another process takes the last of it once the
  conversion has begun, past the free-space check) ended in TensorFlow's traceback, exit 1: now exit 2, naming the
  folder, that its disk is full and how much the records need; the partial folder is removed, and nothing distmis
  did not write (the other process's file) is touched.
* An unwritable ``--output`` beside an external tracking store (which does not need the folder) was found only once
  Ray had started and the data was being converted, with a traceback: now ``distmis run`` refuses it before any
  work, exit 2, naming the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmis.data import synthesize_dataset
from tests.conftest import small_spec_tree
from tests.faults.test_refused_before_work import distmis, write_spec
from tests.mounts import tmpfs, unwritable_folder

pytestmark = pytest.mark.slow  # real distmis processes (seconds of imports each)

ROOT = Path(__file__).resolve().parents[2]


def _fill(disk: Path) -> Path:
    """Write a file of zeros on ``disk`` until it is full; the file."""
    filler = disk / "someone-elses-file"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass
    return filler


def test_a_disk_that_fills_up_while_converting_is_exit_2_naming_it_with_nothing_half_written(tmp_path: Path):
    data = tmp_path / "data"  # 6 cases of 32^3 voxels: about 3.2 MiB of records, which a 4 MiB disk has room for
    synthesize_dataset(data, "msd", cases=6, shape=(32, 32, 32), seed=0, progress=False)
    with tmpfs(tmp_path / "disk", size="4m") as disk:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        process = subprocess.Popen([sys.executable, "-m", "distmis", "data", "tfrecord", str(data), str(disk / "tfr"),
                                    "--quiet", "--workers", "2"], cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            # past the free-space check; its readers take seconds to start, so no shard is written yet
            while not list(disk.glob(".tfr.partial-*")):
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "the conversion did not begin"
                time.sleep(0.01)
            filler = _fill(disk)
            _, stderr = process.communicate(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        assert f"error: the disk holding {str(disk)!r} is full (No space left on device)" in stderr
        assert "they need about 3.2 MiB; 4.0 MiB was free when the conversion started" in stderr
        assert sorted(p.name for p in disk.iterdir()) == [filler.name]  # the partial folder gone, the file kept


def test_an_unwritable_output_beside_an_external_store_is_refused_before_any_work(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    store = tmp_path / "store"
    store.mkdir()
    tree["tracking"] = {"uri": f"sqlite:///{store / 'mlflow.db'}"}  # a store that does not need --output
    spec = write_spec(tmp_path, tree)
    with unwritable_folder(tmp_path / "read-only") as (disk, reason):
        done = distmis("run", str(spec), "--output", str(disk / "out"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (f"error: the output folder {str(disk / 'out')!r} cannot be written in (it would be made in "
            f"{str(disk)!r}): {reason}. Nothing was started") in done.stderr
    assert not done.started_ray
    assert not (tmp_path / "data").exists() and list(store.iterdir()) == []  # no data made, no store touched
