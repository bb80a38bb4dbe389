"""The local Ray a search starts: a dashboard port taken between distmis's check and Ray's bind (another local
Ray starting at the same second) does not stop the search."""

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
import distmis.search.execute as execute
from distmis.service.net import LOOPBACK, free_port

held = socket.socket()
held.bind((LOOPBACK, free_port(LOOPBACK)))
held.listen()
taken = held.getsockname()[1]
execute.port_in_use = lambda host, port: False          # the check said "free" ...
original = execute.local_ray_options
calls = []
def options(port=None):
    calls.append(port)
    return original(taken if port is None else port)   # ... and then the port was taken
execute.local_ray_options = options
with execute.ray_connection():
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
