"""Addresses and ports: what binds to loopback, and which ports are free."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


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
