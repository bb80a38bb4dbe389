"""The service for real on loopback: a ``ray start --head`` cluster, a search submitted through the Ray
Jobs API, and its runs read back through the REST API of an ``mlflow server`` started as ``distmis ui`` does.

Every server is stopped by its fixture or test, also when an assertion fails.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import yaml

from distmis.cli.main import main
from distmis.service.net import free_port, is_loopback
from distmis.service.cluster import ClusterError, ClusterState, auth_headers, cluster_down, cluster_up
from distmis.service.jobs import (
    SubmitError, check_reachable_storage, is_local_store, is_this_machine, job_client,
)
from distmis.spec import validate_spec
from distmis.service.server import store_for
from tests.conftest import small_spec_tree
from tests.sockets import listening

pytestmark = pytest.mark.slow  # real `ray start --head` clusters and MLflow servers


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head node of 2 CPUs on free loopback ports, with its own token and state folder."""
    home = tmp_path_factory.mktemp("distmis_home")
    patch = pytest.MonkeyPatch()
    patch.setenv("DISTMIS_HOME", str(home))
    patch.setenv("RAY_AUTH_TOKEN_PATH", str(home / "auth_token"))
    patch.delenv("RAY_ADDRESS", raising=False)
    patch.delenv("RAY_AUTH_TOKEN", raising=False)
    try:
        yield cluster_up(port=free_port(), dashboard_port=free_port(), num_cpus=2)
    finally:
        if ClusterState.load() is not None:
            cluster_down()
        patch.undo()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@contextmanager
def distmis_ui(*args: str, cwd: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``distmis ui ARGS`` as a user runs it, on a free port; SIGTERM (as ``kill``) when done."""
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "distmis", "ui", *args, "--port", str(port)], cwd=cwd,
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        assert ui.stdout is not None
        line = ui.stdout.readline()  # printed once the server's /health answers
        assert f"MLflow UI at http://127.0.0.1:{port}" in line, line
        tree = psutil.Process(ui.pid).children(recursive=True)
        yield f"http://127.0.0.1:{port}", ui
    finally:
        if ui.poll() is None:
            ui.send_signal(signal.SIGTERM)
            ui.wait(timeout=60)
        _, alive = psutil.wait_procs(tree, timeout=30)
        for process in alive:  # only if stopping failed: the test that stops it asserts this list is empty
            process.kill()


def _listening_hosts(pid: int, port: int) -> set[str]:
    """The addresses on which the process tree of ``pid`` listens on TCP ``port``."""
    root = psutil.Process(pid)
    hosts = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        hosts |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return hosts


# --------------------------------------------------------------------------- cluster up
def test_head_node_is_on_loopback_with_token_authentication(head):
    assert head.dashboard_url.startswith("http://127.0.0.1:") and head.gcs_address.startswith("127.0.0.1:")
    token_file = Path(head.token_path)
    assert token_file.stat().st_mode & 0o077 == 0  # owner-only
    assert _get(f"{head.dashboard_url}/api/version", auth_headers())[0] == 200
    assert _get(f"{head.dashboard_url}/api/version")[0] in (401, 403)  # no token, no answer
    assert _get(f"{head.dashboard_url}/api/version", {"Authorization": "Bearer wrong"})[0] in (401, 403)
    # The dashboard and Jobs API listen on loopback only,
    port = int(head.dashboard_url.rsplit(":", 1)[1])
    hosts = _listening_hosts(head.pid, port)
    assert hosts and all(is_loopback(h.removeprefix("::ffff:")) for h in hosts), hosts
    # and so does every other server of the head (issue 46, finding 11: Ray's GCS, raylet and agents listened on
    # every interface or the machine's address, and its three Prometheus endpoints, which answer without a token,
    # on 0.0.0.0). Those three open last: the dashboard agent's, the autoscaler's and the dashboard's own.
    assert head.single_machine and set(head.metrics_ports) == {"metrics export", "autoscaler metrics",
                                                               "dashboard metrics"}
    deadline = time.monotonic() + 120
    while not set(head.metrics_ports.values()) <= {port for _, port, _ in listening(head.pid)}:
        assert time.monotonic() < deadline, f"not all of {head.metrics_ports} listen: {listening(head.pid)}"
        time.sleep(0.5)
    outward = sorted({s for s in listening(head.pid) if not is_loopback(s[0].removeprefix("::ffff:"))})
    assert not outward, f"listening beyond loopback: {outward}"


def test_second_cluster_up_is_refused(head):
    with pytest.raises(ClusterError, match="already running"):
        cluster_up(port=free_port(), dashboard_port=free_port())


def test_cluster_status_command(head, capsys):
    assert main(["cluster", "status"]) == 0
    out = capsys.readouterr().out
    assert "cluster UP" in out and head.dashboard_url in out and "CPU" in out


# --------------------------------------------------------------------------- submit
def test_bad_spec_never_reaches_the_cluster(head, tmp_path, capsys):
    before = len(job_client(None).list_jobs())
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(tree))
    assert main(["submit", str(tmp_path / "bad.yaml")]) == 2
    assert "training.epochs" in capsys.readouterr().err
    assert len(job_client(None).list_jobs()) == before


def test_submitted_search_succeeds_and_the_ui_serves_its_runs(head, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative paths: resolved here, since the cluster is this machine
    tree = small_spec_tree("data/tiny-msd")
    tree["training"]["epochs"] = 1
    Path("spec.yaml").write_text(yaml.safe_dump(tree))

    assert main(["submit", "spec.yaml", "--follow"]) == 0
    out = capsys.readouterr().out
    job_id = out.split("submitted ", 1)[1].split()[0]
    assert "Best trial" in out and f"job {job_id}: SUCCEEDED" in out
    assert (tmp_path / "data" / "tiny-msd").is_dir() and (tmp_path / "runs" / "tiny" / "mlflow.db").is_file()

    assert main(["jobs"]) == 0
    assert job_id in capsys.readouterr().out
    assert main(["status", job_id]) == 0
    assert f"{job_id}: SUCCEEDED" in capsys.readouterr().out
    assert main(["logs", job_id]) == 0
    assert "Best trial" in capsys.readouterr().out
    assert main(["logs", job_id, "--follow"]) == 0  # the Jobs API's log stream, to the job's end
    assert "Best trial" in capsys.readouterr().out
    assert main(["status", "no-such-job"]) == 2

    with distmis_ui(cwd=tmp_path) as (url, ui):  # no folder named: the one search under runs/
        api = f"{url}/api/2.0/mlflow"
        status, body = _get(f"{api}/experiments/get-by-name?experiment_name=tiny")
        assert status == 200
        experiment = json.loads(body)["experiment"]
        experiment_id = experiment["experiment_id"]
        # Tagged as model training, so MLflow 3's UI opens it on its runs, not on its GenAI traces view.
        assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
        runs = _post(f"{api}/runs/search", {"experiment_ids": [experiment_id], "max_results": 100})["runs"]
        children = [r for r in runs if any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))]
        parents = [r for r in runs if r not in children]
        assert len(parents) == 1 and len(children) == 2
        source = {t["key"]: t["value"] for t in parents[0]["data"]["tags"]}
        assert source["mlflow.source.type"] == "JOB" and source["mlflow.source.name"] == "distmis run"
        # "<trial id> <searched values>" (a TensorFlow grid's trials are made by distmis's searcher: search.affinity)
        names = sorted((r["info"]["run_name"].split(" ", 1) for r in children), key=lambda parts: parts[-1])
        assert [values for _, values in names] == ["lr=0.001", "lr=0.005"] and all(ident for ident, _ in names)
        for child in children:
            metrics = {m["key"] for m in child["data"]["metrics"]}
            assert {"train_loss", "val_loss", "val_dice", "elapsed_seconds"} <= metrics
        parent_id = parents[0]["info"]["run_id"]
        status, body = _get(f"{api}/artifacts/list?run_id={parent_id}")
        assert status == 200
        listed = {f["path"] for f in json.loads(body)["files"]}
        assert {"spec.yaml", "results.csv"} <= listed
        status, body = _get(f"{url}/get-artifact?path=spec.yaml&run_uuid={parent_id}")
        assert status == 200 and yaml.safe_load(body)["name"] == "tiny"

        # ``distmis ui`` ended by SIGTERM (as by ``kill``) stops the mlflow server and its workers with it.
        tree = psutil.Process(ui.pid).children(recursive=True)
        assert any("mlflow" in " ".join(p.cmdline()) and "server" in p.cmdline() for p in tree)
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(tree, timeout=30)
        # (a zombie has ended; whatever adopted it may not collect it)
        assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)


def test_results_on_other_machines_need_reachable_storage(head, tmp_path):
    assert is_this_machine(head.dashboard_url, nodes=1)
    assert not is_this_machine(head.dashboard_url, nodes=2)
    assert not is_this_machine("http://127.0.0.1:1", nodes=1)  # loopback, but maybe a tunnel to elsewhere
    spec = validate_spec(small_spec_tree("data/relative"))
    check_reachable_storage(spec, None, address=head.dashboard_url, local=True, nodes=1)  # this machine: fine
    with pytest.raises(SubmitError) as info:
        check_reachable_storage(spec, None, address="http://127.0.0.1:8265", local=False, nodes=3)
    message = str(info.value)
    assert "tracking.uri" in message and "--output" in message and "dataset.path" in message
    tree = small_spec_tree(tmp_path / "data", tracking={"uri": "http://mlflow.internal:5000"})
    check_reachable_storage(validate_spec(tree), Path("/shared/runs/tiny"), address="http://10.0.0.5:8265",
                            local=False, nodes=4)
    assert is_local_store(None) and is_local_store("sqlite:///x.db") and is_local_store("/a/b")
    assert not is_local_store("postgresql://db/mlflow") and not is_local_store("https://mlflow")


# --------------------------------------------------------------------------- ui store choice
def test_ui_store_choice(tmp_path):
    root = tmp_path / "runs"
    with pytest.raises(ValueError, match="no MLflow store"):
        store_for(None, None, runs_root=root)
    (root / "a").mkdir(parents=True)
    (root / "a" / "mlflow.db").touch()
    uri, artifacts = store_for(None, None, runs_root=root)
    assert uri == f"sqlite:///{(root / 'a' / 'mlflow.db').resolve()}" and artifacts == (root / "a" / "mlartifacts").resolve()
    (root / "b").mkdir()
    (root / "b" / "mlflow.db").touch()
    with pytest.raises(ValueError, match="several searches"):
        store_for(None, None, runs_root=root)
    with pytest.raises(ValueError, match="holds no MLflow store"):
        store_for(tmp_path, None, runs_root=root)
    assert store_for(None, "postgresql://db/mlflow", runs_root=root) == ("postgresql://db/mlflow", None)


# --------------------------------------------------------------------------- down (last: stops the module's head)
class Follower:
    """``distmis ARGS`` in a process of its own, its output read as it comes (a thread per stream)."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "distmis", *args], cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=s, to=to: to.extend(s), daemon=True)
                        for s, to in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out):
            assert self.process.poll() is None, f"exited {self.process.returncode}: {''.join(self.err)[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {''.join(self.out)[-3000:]}"
            time.sleep(0.2)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            self.kill()
        for reader in self.readers:
            reader.join(timeout=30)
        return code, "".join(self.err)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def test_followers_whose_dashboard_goes_say_so_and_cluster_down_stops_only_its_own_processes(head, ray_local,
                                                                                            tmp_path):
    """Issue 46, finding 3: ``logs --follow`` and ``submit --follow`` whose cluster's dashboard goes away end with one
    line saying so (exit 1), not a traceback. The dashboard alone is stopped (SIGTERM, which ``ray start --block``
    takes as a graceful exit), so that nothing is left to mark the jobs ended; then ``cluster down`` stops the rest."""
    client = job_client(None)
    sleeper = client.submit_job(entrypoint="python -c \"import time; print('started', flush=True); time.sleep(600)\"")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(small_spec_tree(tmp_path / "data")))
    logs = Follower("logs", sleeper, "--follow", cwd=tmp_path)
    submit = Follower("submit", "spec.yaml", "--follow", cwd=tmp_path)
    try:
        logs.wait_for("started")  # the job's log is streaming
        submit.wait_for("submitted ")  # the search is on the cluster, followed
        submitted = "".join(submit.out).split("submitted ", 1)[1].split()[0]

        tree = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        assert len(tree) > 3  # ray start, GCS, raylet, dashboard, ...
        dashboard = [p for p in tree if any(arg.endswith("dashboard/dashboard.py") for arg in p.cmdline())]
        assert len(dashboard) == 1, [p.cmdline() for p in tree]
        dashboard[0].terminate()
        for follower, job_id in ((logs, sleeper), (submit, submitted)):
            code, err = follower.finish()
            assert code == 1 and "Traceback" not in err, err[-3000:]
            said = [line for line in err.splitlines() if "lost the Ray cluster" in line]
            assert len(said) == 1 and said[0].startswith("error: "), err[-3000:]
            assert f"at {head.dashboard_url} while following job {job_id}" in said[0]
            assert f"'distmis status {job_id}" in said[0] and f"'distmis logs {job_id}" in said[0]
    finally:
        logs.kill()
        submit.kill()

    stopped = cluster_down()
    assert head.pid in stopped
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert ClusterState.load() is None
    # The session's own local Ray (another cluster on this machine) still works.
    assert ray_local.get(ray_local.remote(lambda: 42).remote()) == 42
