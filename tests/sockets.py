"""What a process tree listens on, for the tests that check servers bind where they should."""

from __future__ import annotations

import psutil


def listening(pid: int) -> list[tuple[str, int, str]]:
    """``(address, port, process name)`` of every TCP socket listening in the process tree of ``pid``."""
    root = psutil.Process(pid)
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            connections = process.net_connections(kind="tcp")
        except psutil.Error:
            continue
        found += [(c.laddr.ip, c.laddr.port, name) for c in connections if c.status == psutil.CONN_LISTEN]
    return found
