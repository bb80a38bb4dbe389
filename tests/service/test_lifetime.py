"""A child started with ``dies_with_parent`` is signalled when its parent is SIGKILLed (issue 46, finding 9: the
mechanism behind ``distmis ui``'s server dying with it; tests/faults/test_ui_killed.py is the real server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import subprocess, sys
from distmis.service.lifetime import dies_with_parent

child = subprocess.Popen(["sleep", "600"], preexec_fn=dies_with_parent(), start_new_session=True)
print(child.pid, flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_dies_with_its_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.ppid() == parent.pid  # in a session of its own, as mlflow server is
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        child.wait(timeout=30)  # psutil.TimeoutExpired while it lives (its sleep lasts 600 s)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child is not None and child.is_running():
            child.kill()


def test_elsewhere_there_is_nothing_to_set(monkeypatch):
    from distmis.service.lifetime import dies_with_parent

    monkeypatch.setattr(sys, "platform", "darwin")
    assert dies_with_parent() is None  # Popen(preexec_fn=None): the child starts as it would anyway
