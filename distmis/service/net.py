"""Addresses and ports: what binds to loopback, and which ports are free."""

from __future__ import annotations

import ipaddress
import socket
import sys

LOOPBACK = "127.0.0.1"

_claims: dict[int, socket.socket] = {}  # the ports this process has claimed (claim_port), by number


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``port`` at ``host`` (``0.0.0.0`` is checked on loopback).

    SO_REUSEADDR, as servers set it: a port whose last connections linger in TIME_WAIT is free.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK if host == "0.0.0.0" else host, port))
        except OSError:
            return True
    return False


def claim_port(port: int) -> bool:
    """Claim ``port`` among the distmis processes of this machine, for as long as this process lives (or until
    :func:`release_port`): True when this process holds the claim, now or from before; False when another does.

    Two processes that start at the same moment both find a port free before either binds it; the claim decides
    which of them takes it. It is an abstract Unix socket named after the port (Linux): the kernel lets one process
    at a time bind a name, in the same network namespace as the port itself, and frees it when that process ends,
    however it ends; there is no file to leave behind. Where there are no abstract sockets (not Linux), True.
    """
    if port in _claims or not sys.platform.startswith("linux"):
        return True
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0distmis-port-{port}")
    except OSError:  # another process holds it
        claim.close()
        return False
    _claims[port] = claim
    return True


def release_port(port: int) -> None:
    """Give up this process's claim on ``port`` (:func:`claim_port`), if it holds one."""
    claim = _claims.pop(port, None)
    if claim is not None:
        claim.close()
