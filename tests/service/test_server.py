"""``distmis ui``'s MLflow server: the store URI reaches it through its environment, never its command line
(which every user of the machine reads with ``ps``), and nothing printed shows a password."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from distmis.service.net import free_port
from distmis.service.server import BACKEND_STORE_ENV, server_command, server_environment, start_server
from distmis.tracking.mlflow_tracking import default_tracking_uri

SECRET = "s3cr3t-pw"
PASSWORD_URI = f"postgresql://alice:{SECRET}@127.0.0.1:5432/mlflow"


def test_command_line_holds_no_store_uri_and_the_environment_does(tmp_path):
    command = server_command(port=5001, artifacts=tmp_path / "mlartifacts")
    env = server_environment(PASSWORD_URI, base={"PATH": "/usr/bin", BACKEND_STORE_ENV: "sqlite:///other.db"})
    assert not any(SECRET in arg or "postgresql" in arg for arg in command)
    assert "--backend-store-uri" not in command
    assert command[command.index("--host") + 1] == "127.0.0.1"  # loopback unless asked otherwise
    assert command[command.index("--port") + 1] == "5001"
    assert command[command.index("--default-artifact-root") + 1] == (tmp_path / "mlartifacts").as_uri()
    assert env == {"PATH": "/usr/bin", BACKEND_STORE_ENV: PASSWORD_URI}  # an ambient store URI is replaced


def test_the_environment_keeps_this_process_environment(monkeypatch):
    monkeypatch.setenv("DISTMIS_TEST_MARK", "kept")
    env = server_environment("sqlite:////tmp/x/mlflow.db")
    assert env["DISTMIS_TEST_MARK"] == "kept" and env[BACKEND_STORE_ENV] == "sqlite:////tmp/x/mlflow.db"


def test_an_empty_store_uri_is_refused():
    # An empty MLFLOW_BACKEND_STORE_URI would make mlflow serve ./mlflow.db instead, silently.
    with pytest.raises(ValueError, match="backend store URI is empty"):
        server_environment("")


def _experiment_names(url: str) -> list[str]:
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search", method="POST",
                                     data=json.dumps({"max_results": 100}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return [e["name"] for e in json.load(response)["experiments"]]


@pytest.mark.slow  # a real mlflow server: about 8 s
def test_real_server_serves_the_store_named_only_in_its_environment(tmp_path):
    from mlflow.tracking import MlflowClient

    output = tmp_path / "runs" / "store-marker-4711"  # the store's path must show in no process's argv
    output.mkdir(parents=True)
    uri = default_tracking_uri(output)
    MlflowClient(uri).create_experiment("served-from-env")
    with start_server(uri, port=free_port(), log_path=tmp_path / "server.log") as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert "served-from-env" in _experiment_names(server.url)  # the env's store, not a default ./mlflow.db
        root = psutil.Process(server.process.pid)
        tree = [root, *root.children(recursive=True)]  # mlflow server, its uvicorn worker, its job runners
        assert len(tree) >= 2
        for process in tree:
            assert "store-marker-4711" not in " ".join(process.cmdline()), process.cmdline()
        assert root.environ()[BACKEND_STORE_ENV] == uri


@pytest.mark.slow  # a real `distmis ui` whose mlflow server fails on the unreachable store: about 6 s
def test_distmis_ui_prints_no_password(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "distmis", "--verbose", "ui", "--tracking-uri", f"postgresql://alice:{SECRET}@127.0.0.1:"
         f"{free_port()}/mlflow", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "postgresql://alice:***@127.0.0.1:" in result.stderr  # the store is named, redacted
    assert SECRET not in result.stdout + result.stderr
    assert not (Path(tmp_path) / "mlflow.db").exists()  # it never fell back to a default store


@pytest.mark.slow
def test_distmis_ui_takes_the_store_from_its_environment(tmp_path):
    """The password need not be on distmis's own command line either: $MLFLOW_BACKEND_STORE_URI names the store."""
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": f"postgresql://alice:{SECRET}@127.0.0.1:{free_port()}/mlflow"}
    result = subprocess.run([sys.executable, "-m", "distmis", "ui", "--port", str(free_port())], env=env,
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # no database there: the server cannot start
    assert "postgresql://alice:***@127.0.0.1:" in result.stderr and SECRET not in result.stdout + result.stderr
