"""Loopback and port helpers."""

from __future__ import annotations

import socket

from distmis.service.net import free_port, is_loopback, port_in_use


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
