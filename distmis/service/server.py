"""``distmis ui``: an MLflow tracking server (and its web UI) over a search's store.

By default it serves the sqlite store a search wrote into its output folder (``runs/<name>/mlflow.db``,
artifacts beside it in ``mlartifacts/``), bound to 127.0.0.1. A team passes a database URI instead
(``postgresql://...``). ``mlflow server`` starts worker processes of its own, so it runs in a session
of its own and is stopped by process group.

The server also dies with the process that started it, even one killed by SIGKILL (which runs no handler). It
runs under :mod:`distmis.service.guard`, which leads its process group: on Linux the kernel sends the guard SIGTERM
when its parent dies (:func:`~distmis.service.lifetime.dies_with_parent`), and the guard stops the whole group,
``mlflow server``, its uvicorn worker, its job runner and that runner's huey consumers (SIGTERM, then SIGKILL after
a few seconds). Elsewhere (macOS, Windows) there is no such signal: a ``distmis ui`` killed by SIGKILL leaves its
server running, to be stopped with ``kill -TERM -PID`` (the server's process group, whose id is the guard's pid).

The store URI can hold a password (``postgresql://user:secret@host/db``). It never goes on the server's
command line, which every user of the machine can read (``ps``, ``/proc/PID/cmdline``): the server gets it
from its environment (:data:`BACKEND_STORE_ENV`, readable only by its owner), as ``mlflow server`` passes
it on to its own workers; and anything printed or logged names the store through
:func:`~distmis.tracking.uri.redact_uri`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from distmis.service.lifetime import dies_with_parent
from distmis.service.net import LOOPBACK, is_loopback, port_in_use
from distmis.tracking.mlflow_tracking import default_tracking_uri
from distmis.tracking.uri import redact_uri

logger = logging.getLogger(__name__)

#: The environment variable ``mlflow server`` reads its ``--backend-store-uri`` from (the option's click envvar).
BACKEND_STORE_ENV = "MLFLOW_BACKEND_STORE_URI"


class ServerError(RuntimeError):
    """The tracking server could not be started; the message says why."""


def find_stores(root: Path) -> list[Path]:
    """Search output folders under ``root`` that hold an MLflow store (``*/mlflow.db``)."""
    return sorted(p.parent for p in root.glob("*/mlflow.db"))


def store_for(output: Path | None, tracking_uri: str | None, *, runs_root: Path) -> tuple[str, Path | None]:
    """The backend store URI to serve and, for a search's own store, its artifact folder.

    ``output``: a search's output folder; ``tracking_uri``: any MLflow store URI; neither: the one
    search under ``runs_root`` (an error lists them if there are several).
    """
    if output is not None and tracking_uri is not None:
        raise ValueError("give a search's output folder or --tracking-uri, not both")
    if tracking_uri is not None:
        return tracking_uri, None
    if output is None:
        stores = find_stores(runs_root)
        if not stores:
            raise ValueError(f"no MLflow store under {runs_root}/ (run a search first, or pass --tracking-uri)")
        if len(stores) > 1:
            listed = ", ".join(str(p) for p in stores)
            raise ValueError(f"several searches under {runs_root}/: {listed}; name one, e.g. 'distmis ui {stores[0]}'")
        output = stores[0]
    if not (output / "mlflow.db").exists():
        raise ValueError(f"{output} holds no MLflow store (no mlflow.db): is it a search's output folder?")
    return default_tracking_uri(output), (output / "mlartifacts").resolve()


@dataclass
class MLflowServer:
    """A running ``mlflow server``; stop it with :meth:`stop` (or use it as a context manager)."""

    process: subprocess.Popen
    url: str
    log_path: Path | None = field(default=None)

    def stop(self, grace: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and its workers
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> MLflowServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_command(*, host: str = LOOPBACK, port: int = 5000, artifacts: Path | None = None) -> list[str]:
    """The ``mlflow server`` command line: no store URI on it (see :func:`server_environment`)."""
    command = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1"]
    if artifacts is not None:  # new experiments created in the UI put their artifacts beside the store
        command += ["--default-artifact-root", artifacts.as_uri()]
    return command


def server_environment(backend_store_uri: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default this process's) with the store URI in :data:`BACKEND_STORE_ENV`.

    Unlike a command-line argument, a process's environment is readable only by its owner (and root).
    """
    if not backend_store_uri:
        raise ValueError("the backend store URI is empty; give a search's output folder or --tracking-uri")
    env = dict(os.environ if base is None else base)
    env[BACKEND_STORE_ENV] = backend_store_uri
    return env


def start_server(
    backend_store_uri: str,
    *,
    artifacts: Path | None = None,
    host: str = LOOPBACK,
    port: int = 5000,
    log_path: Path | None = None,
    timeout: float = 120.0,
) -> MLflowServer:
    """Start ``mlflow server`` (it dies with this process: :func:`dies_with_parent`) and wait until ``/health``
    answers."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be a TCP port in 1..65535, got {port}")
    if port_in_use(host, port):
        raise ServerError(f"port {port} is in use on {host}; pick another with --port")
    if not is_loopback(host):
        logger.warning("the MLflow server listens on %s: anyone who reaches it can read and change every run. "
                       "MLflow has no login here; prefer 127.0.0.1 with an SSH tunnel.", host)
    # The guard leads the server's process group and takes it all down when this process dies (module docstring).
    command = [sys.executable, "-m", "distmis.service.guard",
               *server_command(host=host, port=port, artifacts=artifacts)]
    env = server_environment(backend_store_uri)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True, preexec_fn=dies_with_parent())
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]
    server = MLflowServer(process, f"http://{LOOPBACK if host == '0.0.0.0' else host}:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"mlflow server over {redact_uri(backend_store_uri)} exited with code "
                              f"{process.returncode}" + (f"; see {log_path}" if log_path else ""))
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    server.stop()
    raise ServerError(f"mlflow server did not answer at {server.url}/health within {timeout:.0f} s")
