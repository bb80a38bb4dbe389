"""What ``distmis cluster up`` starts (issue 46, finding 11): on 127.0.0.1 a head in Ray's single-machine mode, whose
every port, its three Prometheus endpoints included, is on loopback, and whose Ray clients join in the same mode; on
another address a head whose open endpoints are named. The real head's sockets are checked in
tests/service/test_cluster.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distmis.service.cluster import (
    METRICS_ENDPOINTS, SINGLE_MACHINE_ENV, ClusterState, client_env, head_command, joins_single_machine_cluster,
    open_endpoints,
)

PORTS = {"metrics export": 41001, "autoscaler metrics": 41002, "dashboard metrics": 41003}


def command(host: str, monkeypatch) -> tuple[list[str], dict[str, str]]:
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    return head_command(host=host, port=6379, dashboard_port=8265, num_cpus=2, num_gpus=None,
                        metrics_ports=PORTS, token=Path("/tmp/token"))


def state(tmp_path: Path, *, single_machine: bool, pid: int | None = None) -> ClusterState:
    return ClusterState(pid=pid or os.getpid(), host="127.0.0.1" if single_machine else "10.0.0.5",
                        gcs_address="127.0.0.1:6399" if single_machine else "10.0.0.5:6399",
                        dashboard_url="http://127.0.0.1:8299", token_path=str(tmp_path / "token"),
                        log_path=str(tmp_path / "log"), started_at=0.0, single_machine=single_machine,
                        metrics_ports=PORTS)


def test_a_loopback_head_runs_in_single_machine_mode_with_every_metrics_port_named(monkeypatch):
    args, env = command("127.0.0.1", monkeypatch)
    assert "--node-ip-address=127.0.0.1" in args and "--dashboard-host=127.0.0.1" in args
    assert {k: env[k] for k in SINGLE_MACHINE_ENV} == SINGLE_MACHINE_ENV
    # Ray's fixed defaults (44217, 44227) would collide with any other Ray of the machine: each is named.
    assert "--metrics-export-port=41001" in args
    assert env["AUTOSCALER_METRIC_PORT"] == "41002" and env["DASHBOARD_METRIC_PORT"] == "41003"
    assert set(PORTS) == set(METRICS_ENDPOINTS)


def test_a_head_for_other_machines_is_not_single_machine(monkeypatch):
    args, env = command("0.0.0.0", monkeypatch)
    assert not any(a.startswith("--node-ip-address") for a in args)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
    assert env["AUTOSCALER_METRIC_PORT"] == "41002" and "--metrics-export-port=41001" in args


def test_the_open_endpoints_of_a_head_for_other_machines_are_named(tmp_path):
    lines = open_endpoints(state(tmp_path, single_machine=False))
    assert [line.split()[0] for line in lines] == ["0.0.0.0:41001", "0.0.0.0:41002", "0.0.0.0:41003"]
    assert all(name in line for name, line in zip(METRICS_ENDPOINTS, lines))
    assert open_endpoints(state(tmp_path, single_machine=True)) == []


def test_ray_clients_of_a_single_machine_head_join_in_its_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path))
    single = state(tmp_path, single_machine=True)
    assert client_env(single) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token"),
                                  **SINGLE_MACHINE_ENV}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in client_env(state(tmp_path, single_machine=False))

    assert not joins_single_machine_cluster("127.0.0.1:6399")  # no cluster saved
    single.save()
    assert joins_single_machine_cluster("127.0.0.1:6399") and joins_single_machine_cluster("auto")
    assert joins_single_machine_cluster("localhost:6399")
    assert not joins_single_machine_cluster("127.0.0.1:6400") and not joins_single_machine_cluster("10.0.0.9:6399")
    state(tmp_path, single_machine=False).save()
    assert not joins_single_machine_cluster("10.0.0.5:6399")


def test_a_head_that_is_not_running_is_not_joined_so(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    state(tmp_path, single_machine=True, pid=int(ended.stdout)).save()
    assert not joins_single_machine_cluster("127.0.0.1:6399")


def test_a_state_file_written_before_these_fields_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path))
    old = {"pid": 1, "host": "127.0.0.1", "gcs_address": "127.0.0.1:6379", "dashboard_url": "http://127.0.0.1:8265",
           "token_path": "/t", "log_path": "/l", "started_at": 0.0}
    ClusterState.path().write_text(json.dumps(old))
    loaded = ClusterState.load()
    assert loaded is not None and not loaded.single_machine and loaded.metrics_ports == {}


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.5"])
def test_the_state_round_trips(tmp_path, monkeypatch, host):
    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path))
    saved = state(tmp_path, single_machine=host == "127.0.0.1")
    saved.save()
    assert ClusterState.load() == saved
