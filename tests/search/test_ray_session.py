"""The local Ray a search starts: a dashboard port taken between distmis's check and Ray's bind (another local
Ray starting at the same second) does not stop the search; its workers have the trial environment, and the first
trial process is one of the workers Ray started ahead of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, socket
import ray
import distmis.search.ray_session as ray_session
from distmis.service.net import LOOPBACK, free_port

held = socket.socket()
held.bind((LOOPBACK, free_port(LOOPBACK)))
held.listen()
taken = held.getsockname()[1]
ray_session.port_in_use = lambda host, port: False          # the check said "free" ...
original = ray_session.local_ray_options
calls = []
def options(port=None):
    calls.append(port)
    return original(taken if port is None else port)   # ... and then the port was taken
ray_session.local_ray_options = options
with ray_session.ray_connection():
    assert ray.is_initialized()
    print("ports", json.dumps({"calls": calls, "taken": taken}))
"""


@pytest.mark.slow  # starts a real local Ray
def test_a_taken_dashboard_port_is_retried_on_a_free_one(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ports"))
    ports = json.loads(line.removeprefix("ports "))
    first, second = ports["calls"]  # the first ray.init failed on the taken port, the second did not
    assert first is None and second not in (None, ports["taken"])


WARM_SCRIPT = """
import json, os, time
import psutil, ray
import distmis.search.ray_session as ray_session

before = dict(os.environ)
with ray_session.ray_connection():
    def idle_workers():  # this Ray's own (its raylet is this process's child): not another Ray's on the machine
        found = set()
        for process in psutil.Process().children(recursive=True):
            try:
                if "ray::IDLE" in " ".join(process.cmdline()):
                    found.add(process.pid)
            except psutil.Error:
                pass
        return found
    deadline = time.monotonic() + 60
    while not idle_workers() and time.monotonic() < deadline:  # started with the node, one per CPU
        time.sleep(0.2)
    idle = idle_workers()

    @ray.remote(num_cpus=1)
    class Trial:
        def where(self):
            return os.getpid(), {name: os.environ.get(name) for name in ray_session.local_worker_env(
                {"dashboard_port": 0})}

    pid, env = ray.get(Trial.remote().where.remote())
    report = {"idle": sorted(idle), "pid": pid, "env": env, "job_runtime_env": ray.get_runtime_context().runtime_env,
              "driver_env_changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
              "trial_env": ray_session.local_worker_env(ray_session.local_ray_options())}
print("warm " + json.dumps(report))
"""


@pytest.mark.slow  # starts a real local Ray
def test_a_trial_process_is_a_worker_ray_started_ahead_and_has_the_trial_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    done = subprocess.run([sys.executable, "-c", WARM_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("warm ")).removeprefix(
        "warm "))
    assert report["idle"] and report["pid"] in report["idle"]  # no cold start for the first trial
    assert not report["job_runtime_env"].get("env_vars")
    # the trial environment was the driver's only while Ray started (what Ray itself sets stays)
    assert not set(report["driver_env_changed"]) & set(report["trial_env"]), report["driver_env_changed"]
    for name, value in report["env"].items():
        if name != "RAY_API_SERVER_ADDRESS":
            assert value == report["trial_env"][name], name
    assert report["env"]["RAY_API_SERVER_ADDRESS"].startswith("http://127.0.0.1:")
