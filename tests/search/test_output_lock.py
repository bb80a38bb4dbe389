"""The output folder's lock (issue 46, 8): one search at a time in a folder, held by the kernel for the process.

A real second process holds the lock (a child Python); this one is refused, naming it, and takes the lock once the
holder is SIGKILLed: no stale lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from distmis.cli.main import main
from distmis.search.output_lock import LOCK_FILE, OutputInUse, output_locked
from tests.conftest import small_spec_tree

HOLD = textwrap.dedent("""
    import sys, time
    from distmis.search.output_lock import output_locked

    with output_locked(sys.argv[1], "distmis run"):
        print("held", flush=True)
        time.sleep(300)
""")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A child process holding ``tmp_path/out``'s lock (until it is killed)."""
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        yield process, out
    finally:
        process.kill()
        process.wait()


def test_a_second_process_is_refused_naming_the_holder_and_takes_the_lock_once_it_is_killed(holder) -> None:
    process, out = holder
    with pytest.raises(OutputInUse) as refused:
        with output_locked(out, "distmis compare"):
            pytest.fail("two processes held one output folder")
    message = str(refused.value)
    assert str(out) in message and f"pid {process.pid} " in message and "distmis run" in message
    assert "another --output" in message
    assert (out / LOCK_FILE).is_file()  # the refused process removed nothing

    process.send_signal(signal.SIGKILL)  # no chance to let go: the kernel does
    process.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == process.pid  # its file stays, its lock does not
    with output_locked(out, "distmis run --resume") as lock:
        assert lock.locked and json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert list(out.iterdir()) == []  # the file is removed at the end; the folder existed, so it stays


def test_the_cli_refuses_a_second_run_before_any_work(holder, tmp_path: Path, capsys) -> None:
    process, out = holder
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(small_spec_tree(tmp_path / "data")))
    for command in (["run", str(spec)], ["compare", str(spec), "--workers", "1"], ["run", str(spec), "--resume"]):
        assert main([*command, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another distmis (pid {process.pid} " in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()  # no data converted (Ray is started after it)
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]


def test_one_process_holds_a_folder_once_and_a_folder_made_for_the_lock_goes_with_it(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    with output_locked(out, "distmis run") as lock:
        assert lock.locked and lock.made_folder
        with pytest.raises(OutputInUse):  # another open of the file is another lock, even in one process
            with output_locked(out, "distmis run"):
                pass
    assert not (tmp_path / "a").exists()  # nothing was written in it: gone, with the folder made above it
    with output_locked(out, "distmis run"):
        (out / "results.csv").write_text("kept")
    assert [p.name for p in out.iterdir()] == ["results.csv"]


def test_a_folder_that_cannot_hold_the_lock_is_left_to_the_search_s_checks(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with output_locked(blocker / "out", "distmis run") as lock:
        assert not lock.locked
    assert blocker.read_text() == "not a folder"
