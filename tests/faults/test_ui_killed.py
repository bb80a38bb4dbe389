"""``distmis ui`` killed with SIGKILL takes its MLflow server with it (issue 46, finding 9).

SIGKILL runs no handler, so ``distmis ui`` cannot stop the server itself: the guard that leads the server's process
group (``mlflow server``, its uvicorn worker, its job runner and that runner's huey consumers) is told by the kernel
that its parent died, and stops the group. A real ``distmis ui`` on a free port, killed once its server answers; the
test then waits for the whole tree it had started to be gone and for the port to refuse connections.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from distmis.service.net import free_port

pytestmark = pytest.mark.slow  # a real mlflow server: about 10 s

GONE_WITHIN_S = 30  # "a few seconds" on a quiet machine; generous for a loaded 2-core one


def running(processes: list[psutil.Process]) -> list[str]:
    """The command lines of those of ``processes`` that still run (a zombie has ended: its parent, or whatever
    adopted it, has not collected it yet)."""
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(process.cmdline())[:160])
        except psutil.Error:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_distmis_ui_leaves_no_server_serving(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from distmis.tracking.mlflow_tracking import default_tracking_uri

    output = tmp_path / "runs" / "tiny"
    output.mkdir(parents=True)
    MlflowClient(default_tracking_uri(output)).create_experiment("tiny")
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "distmis", "ui", str(output), "--port", str(port)], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        assert ui.stdout is not None
        line = ui.stdout.readline()  # printed once the server's /health answers
        assert f"MLflow UI at http://127.0.0.1:{port}" in line, line + ui.communicate(timeout=60)[1][-3000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert response.status == 200
        tree = psutil.Process(ui.pid).children(recursive=True)
        names = running(tree)  # a child that has just ended (a zombie) has no command line left to read
        assert any("mlflow server" in name for name in names) and any("uvicorn" in name for name in names), names

        os.kill(ui.pid, signal.SIGKILL)
        assert ui.wait(timeout=30) == -signal.SIGKILL

        psutil.wait_procs(tree, timeout=GONE_WITHIN_S)
        assert not running(tree), running(tree)
        with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait(timeout=30)
        for process in tree:  # only what this test's `distmis ui` started, and only if the fix failed
            try:
                process.kill()
            except psutil.Error:
                pass
