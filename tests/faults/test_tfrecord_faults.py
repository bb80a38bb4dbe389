"""Issue 32, item 7: faults of the TFRecord conversion, reproduced with real processes and real files.

* A SIGKILL during ``distmis data tfrecord`` left ``.partial-*`` folders that were never removed, and spawn
  pool workers that outlived their parent for over 90 s: the workers now die with their parent, and the next
  run removes the leftovers distmis wrote (a folder of a live conversion is never touched).
* ``--overwrite`` deleted directories and directory symlinks that the manifest does not list: it now replaces
  only the plain files the manifest lists (and the manifest), and refuses, naming it, anything else.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import psutil
import pytest

from distmis.data import DataError, PreprocessConfig, convert_to_tfrecords, discover_cases, synthesize_dataset
from distmis.data.tfrecord import MANIFEST_NAME, PARTIAL_MARKER, read_manifest, remove_leftovers, verify_checksums

T = TypeVar("T")
CONFIG = PreprocessConfig(layout="msd")


def _wait_for(check: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _tfrecord(data: Path, out: Path, log: IO[bytes], *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([sys.executable, "-m", "distmis", "data", "tfrecord", str(data), str(out), "--quiet",
                             *extra], stdout=log, stderr=subprocess.STDOUT, env=env)


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- SIGKILL


#: Another live process in the middle of a conversion, as distmis claims it: its partial folder, its marker
#: locked, a shard begun. It prints the folder and waits (a whole second conversion would cost one more
#: TensorFlow start, and it is only the marker's lock that tells a live conversion from a leftover).
_HOLDER = """
import sys, time, uuid
from pathlib import Path
from distmis.data.tfrecord import _claim
out = Path(sys.argv[1])
tag = uuid.uuid4().hex[:8]
folder = out.parent / f".{out.name}.partial-{__import__('os').getpid()}-{tag}"
folder.mkdir()
_claim(folder, tag)
(folder / "train-00000-of-00001.tfrecord").write_bytes(b"begun")
print(folder, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_sigkill_kills_the_pool_workers_and_the_next_run_removes_the_leftover(tmp_path: Path) -> None:
    data = tmp_path / "syn"
    synthesize_dataset(data, "msd", cases=12, shape=(32, 32, 32), seed=0, progress=False)
    work = tmp_path / "out"
    work.mkdir()
    log = (tmp_path / "a.log").open("wb")
    started = time.monotonic()
    a = _tfrecord(data, work / "a", log, "--workers", "2", "--shards", "12")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(work / "b")], stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        assert holder.stdout is not None
        held = Path(holder.stdout.readline().strip())
        held_before = _listing(held)

        def a_converting() -> list[psutil.Process] | None:
            assert a.poll() is None, (tmp_path / "a.log").read_text()
            found = _partials(work, "a")
            if not found or len(list(found[0].glob("*.tfrecord"))) < 2:  # a shard done: the workers convert
                return None
            try:
                procs = psutil.Process(a.pid).children(recursive=True)
                workers = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
            except psutil.Error:  # one ended between the two calls: look again
                return None
            return procs if len(workers) == 2 else None

        children = _wait_for(a_converting, 60, "conversion a's workers at work")
        a_partial = _partials(work, "a")[0]
        os.kill(a.pid, signal.SIGKILL)  # the parent only, as a kill -9 of the command does
        assert a.wait(timeout=10) == -signal.SIGKILL
        killed = time.monotonic()
        _wait_for(lambda: all(_gone(p) for p in children) or None, 10,
                  f"the pool workers {[p.pid for p in children]} to end with their parent")
        workers_gone = time.monotonic() - killed
        assert a_partial.is_dir()  # what the kill leaves

        # The next run into the same folder: removes a's leftover, leaves the live one beside it, succeeds.
        again = subprocess.run([sys.executable, "-m", "distmis", "data", "tfrecord", str(data), str(work / "a"),
                                "--quiet", "--workers", "2"], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        next_run = time.monotonic() - killed
        assert _partials(work, "a") == [] and not a_partial.exists()
        verify_checksums(work / "a")
        assert held.is_dir() and _listing(held) == held_before
    finally:
        for proc in children:  # only if the test failed: the workers it recorded, by their own identity
            if not _gone(proc):
                proc.kill()
        for proc in (a, holder):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        log.close()
    # Its owner gone, the held folder is a leftover too.
    remove_leftovers(work / "b")
    assert _listing(work) == ["a"]
    print(f"workers gone {workers_gone:.2f} s after the kill; kill at {killed - started:.1f} s; next run "
          f"{next_run:.1f} s; test {time.monotonic() - started:.1f} s")


# --------------------------------------------------------------------------- leftovers, in process


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "syn"
    synthesize_dataset(root, "msd", cases=3, shape=(8, 8, 8), seed=0, progress=False)
    return root


def _convert(data: Path, out: Path, *, overwrite: bool = False, train: int = 2) -> dict:
    cases = discover_cases(data, "msd")
    ids = sorted(c.case_id for c in cases)
    split = {"seed": 0, "train": ids[:train], "val": ids[train:], "test": []}
    return convert_to_tfrecords(cases, split, CONFIG, out, workers=1, progress=False, overwrite=overwrite)


@pytest.fixture(scope="module")
def written(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("written") / "tfr"
    _convert(dataset, out)
    return out


def test_leftovers_distmis_can_prove_it_wrote_are_removed_and_nothing_else(dataset: Path, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    dead = _dead_pid()
    # A leftover of a killed run: its marker is not locked (its owner is dead), a shard and a manifest in it.
    killed = tmp_path / f".tfr.partial-{dead}-0123abcd"
    killed.mkdir()
    (killed / PARTIAL_MARKER).write_text("{}")
    (killed / "train-00000-of-00001.tfrecord").write_bytes(b"x")
    (killed / MANIFEST_NAME).write_text("{}")
    # The same, for another output folder beside it: the marker proves it is distmis's too.
    other = tmp_path / f".other.partial-{dead}-0123abcd"
    other.mkdir()
    (other / PARTIAL_MARKER).write_text("{}")
    (other / "val-00000-of-00001.tfrecord").write_bytes(b"x")
    # A leftover with a file distmis did not write: distmis's files go, the stranger stays, and so the folder.
    mixed = tmp_path / f".tfr.partial-{dead}-4567cdef"
    mixed.mkdir()
    (mixed / PARTIAL_MARKER).write_text("{}")
    (mixed / "train-00000-of-00001.tfrecord").write_bytes(b"x")
    (mixed / "notes.txt").write_text("keep me")
    # No marker: nothing proves distmis wrote it, though its name says so.
    unproven = tmp_path / f".tfr.partial-{dead}-89abcdef"
    unproven.mkdir()
    (unproven / "train-00000-of-00001.tfrecord").write_bytes(b"keep")
    # A live conversion (its marker locked, as its owner holds it): untouched.
    live = tmp_path / f".tfr.partial-{os.getpid()}-fedcba98"
    live.mkdir()
    (live / PARTIAL_MARKER).write_text("{}")
    (live / "train-00000-of-00001.tfrecord").write_bytes(b"keep")
    with open(live / PARTIAL_MARKER, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _convert(dataset, tmp_path / "tfr")
        assert _listing(live) == [PARTIAL_MARKER, "train-00000-of-00001.tfrecord"]
    assert not killed.exists() and not other.exists()
    assert _listing(mixed) == [PARTIAL_MARKER, "notes.txt"] and (mixed / "notes.txt").read_text() == "keep me"
    assert f"left {mixed} in place" in caplog.text
    assert "'notes.txt' (a file distmis does not write there)" in caplog.text
    assert (unproven / "train-00000-of-00001.tfrecord").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tfr", live.name, mixed.name, unproven.name])


def test_the_search_data_preparation_removes_leftovers_too(tmp_path: Path) -> None:
    """``prepare_data`` converts with :func:`convert_to_tfrecords`: a leftover of a killed search's conversion
    (another fingerprint, the same tfrecords folder) is removed by the next search's."""
    from distmis.search.prepare import prepare_data
    from distmis.spec import validate_spec
    from tests.conftest import small_spec_tree

    tfrecords = tmp_path / "out" / "tfrecords"
    leftover = tfrecords / f".0123456789abcdef.partial-{_dead_pid()}-0123abcd"
    leftover.mkdir(parents=True)
    (leftover / PARTIAL_MARKER).write_text("{}")
    (leftover / "train-00000-of-00002.tfrecord").write_bytes(b"x")
    prepared = prepare_data(validate_spec(small_spec_tree(tmp_path / "data")), tmp_path / "out", progress=False)
    assert _listing(tfrecords) == [prepared.tfrecord_dir.name]


def test_an_overwrite_killed_between_its_renames_is_restored(written: Path, dataset: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A kill after the old folder was moved aside, before the new one took its place: the next run puts the
    old one back (and replaces it, as asked); an aside folder next to a present output is cleared by its manifest."""
    aside = tmp_path / f".tfr.old-{_dead_pid()}-0123abcd"
    shutil.copytree(written, aside)
    before = read_manifest(aside)
    with pytest.raises(DataError, match="already exists"):
        _convert(dataset, tmp_path / "tfr", train=1)
    assert read_manifest(tmp_path / "tfr") == before and not aside.exists()
    assert f"restored {tmp_path / 'tfr'} from {aside}" in caplog.text
    assert _convert(dataset, tmp_path / "tfr", overwrite=True, train=1).splits["train"]["num_cases"] == 1
    aside2 = tmp_path / f".tfr.old-{_dead_pid()}-4567cdef"
    shutil.copytree(written, aside2)
    (aside2 / "notes.txt").write_text("keep me")
    _convert(dataset, tmp_path / "tfr", overwrite=True)
    assert _listing(aside2) == ["notes.txt"]
    assert f"kept {aside2}" in caplog.text and "'notes.txt' (a file the manifest does not list)" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["tfr", aside2.name])


# --------------------------------------------------------------------------- --overwrite


def _copy(written: Path, tmp_path: Path) -> Path:
    target = tmp_path / "tfr"
    shutil.copytree(written, target, symlinks=True)
    return target


def test_overwrite_refuses_an_unlisted_directory(written: Path, dataset: Path, tmp_path: Path) -> None:
    target = _copy(written, tmp_path)
    (target / "extra").mkdir()
    (target / "empty").mkdir()
    (target / "extra" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"'empty/' \(a folder\).*'extra/' \(a folder\).*plain files"):
        _convert(dataset, target, overwrite=True, train=1)
    assert (target / "extra" / "notes.txt").read_text() == "keep me" and (target / "empty").is_dir()
    assert read_manifest(target) == read_manifest(written)
    assert _listing(tmp_path) == ["tfr"]


def test_overwrite_refuses_a_directory_symlink_and_keeps_its_target(written: Path, dataset: Path,
                                                                    tmp_path: Path) -> None:
    target = _copy(written, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("keep me")
    (target / "linked").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DataError, match=r"'linked' \(a symlink to .*elsewhere'\)"):
        _convert(dataset, target, overwrite=True, train=1)
    assert (target / "linked").is_symlink() and (elsewhere / "notes.txt").read_text() == "keep me"
    assert _listing(tmp_path) == ["elsewhere", "tfr"]


def test_overwrite_never_deletes_the_target_of_a_listed_symlink(written: Path, dataset: Path, tmp_path: Path) -> None:
    target = _copy(written, tmp_path)
    shard = read_manifest(target).splits["train"]["shards"][0]["file"]
    kept = tmp_path / "kept.tfrecord"
    (target / shard).rename(kept)
    (target / shard).symlink_to(kept)
    with pytest.raises(DataError,
                       match=rf"'{shard}' \(a symlink to .*kept.tfrecord', where distmis wrote a plain file\)"):
        _convert(dataset, target, overwrite=True, train=1)
    assert (target / shard).is_symlink() and kept.read_bytes() == (written / shard).read_bytes()


def test_overwrite_refuses_a_symlinked_output_folder(written: Path, dataset: Path, tmp_path: Path) -> None:
    real = _copy(written, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(DataError, match=r"'.*link' is a symlink.*choose"):
        _convert(dataset, link, overwrite=True, train=1)
    assert link.is_symlink() and read_manifest(real) == read_manifest(written)
    assert _listing(real) == _listing(written)
    assert _listing(tmp_path) == ["link", "tfr"]


def test_overwrite_replaces_exactly_the_listed_files(written: Path, dataset: Path, tmp_path: Path) -> None:
    target = _copy(written, tmp_path)
    inode = (target / MANIFEST_NAME).stat().st_ino
    manifest = _convert(dataset, target, overwrite=True, train=1)
    assert read_manifest(target) == manifest and (target / MANIFEST_NAME).stat().st_ino != inode
    assert _listing(target) == [MANIFEST_NAME, "train-00000-of-00001.tfrecord", "val-00000-of-00001.tfrecord"]
    assert _listing(tmp_path) == ["tfr"]


@pytest.mark.parametrize("step", ["generation", "conversion"])
def test_a_ctrl_c_the_moment_the_partial_folder_is_made_leaves_no_folder(dataset: Path, tmp_path: Path, monkeypatch,
                                                                         step: str) -> None:
    """The KeyboardInterrupt of a Ctrl-C can come as ``mkdir`` returns, after the folder was made and before the
    code that removes it on failure holds it (a loaded machine's driver, descheduled there, took the signal then)."""
    made = Path.mkdir

    def made_then_interrupted(self: Path, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        if ".partial-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        if step == "generation":
            synthesize_dataset(tmp_path / "syn", "msd", cases=1, shape=(8, 8, 8), seed=0, progress=False)
        else:
            _convert(dataset, tmp_path / "tfr")
    assert _listing(tmp_path) == []
