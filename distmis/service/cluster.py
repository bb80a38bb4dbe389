"""A Ray head node on this machine, started, inspected and stopped by ``distmis cluster up|status|down``.

``cluster up`` runs ``ray start --head --block`` as a child in its own session, with token
authentication on and every server bound to 127.0.0.1 unless ``host`` says otherwise, and writes what
it started to ``$DISTMIS_HOME/cluster.json`` (default ``~/.distmis``). ``cluster down`` stops that
process tree and nothing else: other Ray processes on the machine (a notebook's ``ray.init()``, another
user's cluster) are left alone, unlike ``ray stop``.

Ray 2.60 binds its servers (GCS, raylet, workers, the agents, three Prometheus endpoints) to every interface, or
to the node's address, unless the node's address is 127.0.0.1; and it replaces a node address of 127.0.0.1 by the
machine's outward one, except in its single-machine mode (:data:`SINGLE_MACHINE_ENV`). So a head on 127.0.0.1 (the
default) runs in that mode: every port on 127.0.0.1, and no other machine can join. Ray's own clients of such a
head need the mode too (:func:`client_env`, :func:`joins_single_machine_cluster`). A head on another address
takes other machines, and its Prometheus endpoints (:data:`METRICS_ENDPOINTS`) then answer anyone, without a
token: ``cluster up`` says so, with their ports.

Token authentication: the Ray Jobs API runs whatever it is sent, so the head starts with
``RAY_AUTH_MODE=token`` and a token file (``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``, made
with mode 0600 when missing; one that others can read is refused: :mod:`distmis.service.token`). Clients of
this package read the same file; other machines need a copy of it (``docs/cluster.md``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distmis.service.net import LOOPBACK, free_port, is_loopback, port_in_use
from distmis.service.token import auth_env, auth_headers, ensure_token, token_problem  # noqa: F401

logger = logging.getLogger(__name__)

#: Ray's single-machine mode (``ray_constants.ENABLE_RAY_CLUSTER`` off, read when Ray is imported): the node's
#: address stays 127.0.0.1, so every server binds there; the head's processes and Ray's clients of it need it.
SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

#: Ray's Prometheus endpoints, which answer without a token: what each serves, and how Ray is told its port (a
#: ``ray start`` option, or the environment variable its process reads). Ray binds them to 127.0.0.1 on a
#: single-machine head, else to every interface (0.0.0.0) whatever ``--host`` says.
METRICS_ENDPOINTS = {
    "metrics export": ("the node's metrics (resource use; node, job, task and actor names)", "--metrics-export-port"),
    "autoscaler metrics": ("the autoscaler's metrics (nodes, pending resources)", "AUTOSCALER_METRIC_PORT"),
    "dashboard metrics": ("the dashboard's own metrics (its requests)", "DASHBOARD_METRIC_PORT"),
}


class ClusterError(RuntimeError):
    """The cluster could not be started, found or stopped; the message says why."""


# --------------------------------------------------------------------------- home
def distmis_home() -> Path:
    return Path(os.environ.get("DISTMIS_HOME", "~/.distmis")).expanduser()


# --------------------------------------------------------------------------- state
@dataclass
class ClusterState:
    """What ``cluster up`` started; saved as JSON so later commands find it."""

    pid: int                 # the ``ray start --head --block`` process (leader of its own session)
    host: str
    gcs_address: str         # for ``ray.init(address=...)`` and worker nodes
    dashboard_url: str       # for the Jobs API (``distmis submit --address``)
    token_path: str
    log_path: str
    started_at: float
    single_machine: bool = False  # Ray's single-machine mode: every port on 127.0.0.1, no other machine joins
    metrics_ports: dict[str, int] = field(default_factory=dict)  # METRICS_ENDPOINTS' ports

    @staticmethod
    def path() -> Path:
        return distmis_home() / "cluster.json"

    def save(self) -> None:
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls) -> ClusterState | None:
        path = cls.path()
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ClusterError(f"{path} is not a cluster state file written by 'distmis cluster up': {exc}") from exc


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive_nodes(dashboard_url: str, timeout: float = 30.0) -> int:
    """Alive nodes of the cluster behind ``dashboard_url`` (its State API); raises OSError if unreachable."""
    request = urllib.request.Request(f"{dashboard_url}/api/v0/nodes?limit=1000&detail=false", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        nodes = json.load(response)["data"]["result"]["result"]
    return sum(1 for node in nodes if node.get("state") == "ALIVE")


def dashboard_ready(url: str, timeout: float = 2.0) -> bool:
    """True when the dashboard answers an authenticated request and a node has joined."""
    try:
        return alive_nodes(url, timeout=timeout) > 0
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False


# --------------------------------------------------------------------------- up / status / down
def cluster_up(
    *,
    host: str = LOOPBACK,
    port: int = 6379,
    dashboard_port: int = 8265,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout: float = 90.0,
) -> ClusterState:
    """Start a Ray head node with the dashboard and the job server; wait until it answers."""
    host = LOOPBACK if host == "localhost" else host
    existing = ClusterState.load()
    if existing is not None and _alive(existing.pid):
        raise ClusterError(f"a cluster started by 'distmis cluster up' is already running (pid {existing.pid}, "
                           f"{existing.dashboard_url}); stop it with 'distmis cluster down' first")
    token = ensure_token()
    problem = token_problem(token)
    if problem:
        raise ValueError(problem)
    for name, value in (("--port", port), ("--dashboard-port", dashboard_port)):
        if not 0 < value < 65536:
            raise ValueError(f"{name} must be a TCP port in 1..65535, got {value}")
        if port_in_use(host, value):
            raise ClusterError(f"{name} {value} is in use on {host} (another Ray head?); pick another with {name}")
    for name, count in (("--num-cpus", num_cpus), ("--num-gpus", num_gpus)):
        if count is not None and count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    if not is_loopback(host):
        logger.warning(
            "binding the Ray head to %s: anyone who reaches this address and holds the token can run code here. "
            "Keep the token secret and the port behind a firewall; prefer 127.0.0.1 with an SSH tunnel.", host)

    home = distmis_home()
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "cluster.log"
    bind_ip = LOOPBACK if host == "0.0.0.0" else host
    metrics_ports = {name: free_port() for name in METRICS_ENDPOINTS}
    command, env = head_command(host=host, port=port, dashboard_port=dashboard_port, num_cpus=num_cpus,
                                num_gpus=num_gpus, metrics_ports=metrics_ports, token=token)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    state = ClusterState(pid=process.pid, host=host, gcs_address=f"{bind_ip}:{port}",
                         dashboard_url=f"http://{bind_ip}:{dashboard_port}", token_path=str(token),
                         log_path=str(log_path), started_at=time.time(), single_machine=host == LOOPBACK,
                         metrics_ports=metrics_ports)
    state.save()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            ClusterState.path().unlink(missing_ok=True)
            raise ClusterError(f"'ray start --head' exited with code {process.returncode}; "
                               f"last lines of {log_path}:\n{_tail(log_path)}")
        if dashboard_ready(state.dashboard_url):
            return state
        time.sleep(0.5)
    _stop_tree(process.pid, grace=10.0)
    ClusterState.path().unlink(missing_ok=True)
    raise ClusterError(f"the Ray head did not answer at {state.dashboard_url} within {timeout:.0f} s; "
                       f"last lines of {log_path}:\n{_tail(log_path)}")


def head_command(*, host: str, port: int, dashboard_port: int, num_cpus: int | None, num_gpus: int | None,
                 metrics_ports: dict[str, int], token: Path) -> tuple[list[str], dict[str, str]]:
    """The ``ray start --head`` command line of ``cluster up`` and its environment.

    Every port with a fixed default in Ray is named (free ones where the user named none): a second Ray on the
    machine may hold the default already. On 127.0.0.1 the head runs in Ray's single-machine mode
    (:data:`SINGLE_MACHINE_ENV`): otherwise Ray would put its node on the machine's outward address, and bind its
    GCS, raylet and workers to every interface and its agents and Prometheus endpoints there or to every interface.
    """
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        f"--port={port}", f"--dashboard-host={host}", f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]
    if host != "0.0.0.0":
        command.append(f"--node-ip-address={host}")
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus}")
    env = {**os.environ, **auth_env(token)}
    for name, (_, setting) in METRICS_ENDPOINTS.items():
        if setting.startswith("--"):
            command.append(f"{setting}={metrics_ports[name]}")
        else:
            env[setting] = str(metrics_ports[name])
    if host == LOOPBACK:
        env.update(SINGLE_MACHINE_ENV)
    # Jobs run ``python -m distmis``: put this interpreter's folder first so they find this installation.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return command, env


def open_endpoints(state: ClusterState) -> list[str]:
    """What of the cluster answers any machine without a token, one line each (none on a single-machine head)."""
    if state.single_machine:
        return []
    return [f"0.0.0.0:{port}  {name}: {METRICS_ENDPOINTS[name][0]}" for name, port in state.metrics_ports.items()]


def client_env(state: ClusterState) -> dict[str, str]:
    """What a Ray client of ``state``'s cluster (``ray status``, ``ray.init``) needs in its environment: the token,
    and on a single-machine head Ray's single-machine mode, without which the client looks for the GCS at the
    machine's outward address and times out."""
    return {**auth_env(Path(state.token_path)), **(SINGLE_MACHINE_ENV if state.single_machine else {})}


def joins_single_machine_cluster(address: str) -> bool:
    """True when ``ray.init(address=address)`` joins the single-machine head that ``cluster up`` started here (its
    GCS address, or ``auto``, which finds it): the driver must then be in Ray's single-machine mode too."""
    try:
        state = ClusterState.load()
    except ClusterError:
        return False
    if state is None or not state.single_machine or not _alive(state.pid):
        return False
    port = state.gcs_address.rsplit(":", 1)[1]
    return address in ("auto", state.gcs_address, f"localhost:{port}")


def cluster_alive(state: ClusterState) -> bool:
    """Its ``ray start`` process runs and its dashboard answers."""
    return _alive(state.pid) and dashboard_ready(state.dashboard_url)


def cluster_status() -> tuple[ClusterState, bool]:
    """The saved cluster and whether it is up."""
    state = ClusterState.load()
    if state is None:
        raise ClusterError(f"no cluster started by 'distmis cluster up' ({ClusterState.path()} does not exist)")
    return state, cluster_alive(state)


def cluster_resources(state: ClusterState) -> str:
    """``ray status`` of the saved cluster (nodes and resources), as text."""
    env = {**os.environ, **client_env(state)}
    command = [str(Path(sys.executable).parent / "ray"), "status", f"--address={state.gcs_address}"]
    for _ in range(20):  # the autoscaler publishes the first status a few seconds after start
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        text = (result.stdout or result.stderr).strip()
        if result.returncode == 0 and not text.startswith("No cluster status"):
            break
        time.sleep(1)
    return text


def cluster_down(timeout: float = 60.0) -> list[int]:
    """Stop the cluster ``cluster up`` started (and only it); the pids that were running."""
    state = ClusterState.load()
    if state is None:
        raise ClusterError(f"no cluster started by 'distmis cluster up' ({ClusterState.path()} does not exist)")
    stopped = _stop_tree(state.pid, grace=timeout) if _alive(state.pid) else []
    ClusterState.path().unlink(missing_ok=True)
    return stopped


def _stop_tree(pid: int, *, grace: float) -> list[int]:
    """SIGTERM ``pid`` (``ray start --block`` then stops its services), then SIGKILL whatever of its tree remains.

    The tree is listed before anything is signalled: Ray's workers are children of the raylet, which
    is a child of ``pid``; once a parent dies its children are re-parented and could not be found.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    pids = [p.pid for p in tree]
    try:
        root.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return pids


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def default_dashboard_address() -> str | None:
    """The Jobs API address commands use when none is given: the saved cluster's, else ``$RAY_ADDRESS``."""
    state = ClusterState.load()
    if state is not None:
        return state.dashboard_url
    return os.environ.get("RAY_ADDRESS")
