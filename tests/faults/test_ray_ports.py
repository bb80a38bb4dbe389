"""The local Ray of ``distmis run`` listens on 127.0.0.1 only (issue 32, item 7): its Prometheus metrics export port,
and every other port of its processes (GCS, raylet, workers, the dashboard and its agents).

Ray 2.60 binds most of these to every interface unless its node's address is loopback, and replaces a node address
of 127.0.0.1 by the machine's outward one; ``distmis.search.ray_session.loopback_node`` keeps 127.0.0.1. The Ray is
started as ``distmis run`` starts it (``ray_connection``), in a process of its own, and its sockets are read from
the kernel (psutil).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmis.service.net import is_loopback
from tests.sockets import listening

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import ray
from distmis.search.ray_session import ray_connection

with ray_connection():
    ray.get(ray.remote(lambda: 0).remote())  # a worker runs, with its own server
    node = ray.nodes()[0]
    print(json.dumps({"ip": node["NodeManagerAddress"], "metrics": node["MetricsExportPort"]}), flush=True)
    sys.stdin.readline()
"""


def loopback(address: str) -> bool:
    return is_loopback(address.removeprefix("::ffff:"))  # an IPv4 address on a dual-stack socket


@pytest.mark.slow  # starts a real local Ray
def test_the_local_ray_of_a_run_listens_on_loopback_only(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "auth_token")
    driver = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert driver.stdout is not None and driver.stdin is not None
        line = driver.stdout.readline()
        assert line, driver.communicate(timeout=60)[1][-3000:]
        node = json.loads(line)
        assert node["ip"] == "127.0.0.1", f"the node's address is {node['ip']}, not loopback"
        metrics = int(node["metrics"])
        deadline = time.monotonic() + 60  # the dashboard agent opens the metrics port once its modules load
        while not any(port == metrics for _, port, _ in listening(driver.pid)):
            assert time.monotonic() < deadline, f"nothing listens on the metrics export port {metrics}"
            time.sleep(0.5)
        sockets = listening(driver.pid)
        on_metrics = {address for address, port, _ in sockets if port == metrics}
        assert on_metrics == {"127.0.0.1"}, f"the metrics export port {metrics} listens on {on_metrics}"
        outward = sorted({(address, port, name) for address, port, name in sockets if not loopback(address)})
        assert not outward, f"listening beyond loopback: {outward}"
        assert len({name for _, _, name in sockets}) >= 3  # the driver, GCS, raylet, agents, a worker: all read
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(timeout=120) == 0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)


RACER = """
import json, sys
import ray
import distmis.search.ray_session as ray_session

ray_session.RAY_DASHBOARD_PORT = int(sys.argv[1])  # "Ray's usual port", free: 8265 may be taken on this machine
print("ready", flush=True)
sys.stdin.readline()  # both start their Ray at the same moment
with ray_session.ray_connection():
    url = ray._private.worker._global_node.address_info["webui_url"]
    print(json.dumps({"dashboard": int(url.rsplit(":", 1)[1])}), flush=True)
    sys.stdin.readline()  # both Rays up at once
"""


@pytest.mark.slow  # starts two real local Rays
def test_two_local_rays_started_at_once_both_start_without_errors(tmp_path: Path):
    """Issue 46, finding 12: two ``distmis run``s on one machine start their local Rays at the same moment. Both saw
    Ray's usual dashboard port free and both chose it; the one whose dashboard lost the race to bind it waited out
    Ray's 60 s dashboard timeout, printed Ray's ERROR lines, and started again on another port."""
    from distmis.service.net import free_port

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "auth_token")
    usual = free_port()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(usual)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
              for _ in range(2)]
    try:
        for racer in racers:
            assert racer.stdout is not None and racer.stdout.readline() == "ready\n", racer.communicate()[1][-3000:]
        for racer in racers:
            assert racer.stdin is not None
            racer.stdin.write("\n")
            racer.stdin.flush()
        ports = []
        for racer in racers:
            assert racer.stdout is not None
            line = racer.stdout.readline()
            assert line, racer.communicate(timeout=60)[1][-3000:]
            ports.append(json.loads(line)["dashboard"])
        assert usual in ports and len(set(ports)) == 2, ports  # one took the usual port, the other another one
        for racer in racers:
            _, err = racer.communicate("\n", timeout=120)
            assert racer.returncode == 0, err[-3000:]
            assert "ERROR" not in err and "Failed to start the dashboard" not in err, err[-3000:]
    finally:
        for racer in racers:
            if racer.poll() is None:
                os.killpg(racer.pid, signal.SIGKILL)
                racer.wait(timeout=30)
