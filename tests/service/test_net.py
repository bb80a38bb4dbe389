"""Loopback and port helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distmis.service.net import claim_port, free_port, is_loopback, port_in_use, release_port

ROOT = Path(__file__).resolve().parents[2]


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.org")


def test_port_in_use_only_while_something_listens():
    port = free_port()
    assert not port_in_use("127.0.0.1", port)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert port_in_use("127.0.0.1", port) and port_in_use("0.0.0.0", port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end of the connection lingers in TIME_WAIT
        client.close()
    assert not port_in_use("127.0.0.1", port)  # a restarted server may bind it again


CLAIMER = """
import sys
from distmis.service.net import claim_port

print(claim_port(int(sys.argv[1])), flush=True)
sys.stdin.readline()
"""


def claimer(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLAIMER, str(port)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def refused_to_another_process(port: int) -> bool:
    other = claimer(port)
    said, _ = other.communicate("\n", timeout=60)
    return said.strip() == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_one_process_at_a_time_claims_a_port_until_it_releases_it_or_ends():
    """Issue 46, finding 12: the claim that keeps two local Rays starting at once from both taking Ray's usual
    dashboard port (tests/faults/test_ray_ports.py starts the two Rays)."""
    port = free_port()
    assert claim_port(port) and claim_port(port)  # held, and held again by the same process
    try:
        assert refused_to_another_process(port)
    finally:
        release_port(port)
    assert not refused_to_another_process(port)

    holder = claimer(port)  # a process that holds the claim and is SIGKILLed: the kernel frees it
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert not claim_port(port)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        assert claim_port(port)
    finally:
        release_port(port)
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
