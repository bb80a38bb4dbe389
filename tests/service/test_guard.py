"""``python -m distmis.service.guard COMMAND``: the whole process group of COMMAND goes when the process that started
the guard is SIGKILLed, grandchildren included (issue 46, finding 9: ``mlflow server``'s huey consumers outlived it);
a COMMAND that ends by itself ends the guard with its exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# As start_server starts the guard: in a session of its own, with the parent-death signal.
PARENT = """
import subprocess, sys
from distmis.service.lifetime import dies_with_parent

guard = subprocess.Popen([sys.executable, "-m", "distmis.service.guard", "sh", "-c", sys.argv[1]],
                         preexec_fn=dies_with_parent(), start_new_session=True)
print(guard.pid, flush=True)
sys.stdin.readline()
"""


def group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_guarded_group_goes_with_the_sigkilled_parent_grandchildren_included():
    # `sh` starts a grandchild that outlives it when `sh` alone is stopped (it is not waited for, nor signalled).
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "sleep 600 & sleep 601; wait"], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    guard = 0
    try:
        assert parent.stdout is not None
        guard = int(parent.stdout.readline())
        for _ in range(300):  # the guard, sh and both sleeps
            if len(group(guard)) == 4:
                break
            time.sleep(0.1)  # psutil.wait_procs([]) returns at once: it waited for nothing
        members = group(guard)
        assert len(members) == 4, [p.cmdline() for p in members]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs(members, timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if guard:
            for process in group(guard):
                process.kill()


def test_a_command_that_ends_by_itself_ends_the_guard_with_its_code():
    done = subprocess.run([sys.executable, "-m", "distmis.service.guard", "sh", "-c", "exit 3"], cwd=ROOT,
                          timeout=60)
    assert done.returncode == 3
