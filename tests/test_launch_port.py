"""`accel launch`'s check that its rendezvous port is free, right after a run on that port.

A run's connections stay in TIME_WAIT for a minute after it ends; the check refused the port
that whole minute (its probe bound without SO_REUSEADDR, which torch's TCPStore sets), so a
job restarted at once on the same port failed (issue 43). A port something listens on is
still refused.
"""

from __future__ import annotations

import socket

import pytest

from accel.cli._launch import _check_port_free


def _time_wait_port() -> int:
    """A port whose last connection was closed by its server side: it lingers in TIME_WAIT.
    The server binds as torch's TCPStore does (SO_REUSEADDR), which its connections inherit."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its end goes to TIME_WAIT
            client.recv(1)
    return port


def test_a_port_just_used_by_a_run_is_free_again() -> None:
    port = _time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))  # what the old check did: refused for a minute
    _check_port_free(port)


def test_a_port_in_use_is_refused() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        with pytest.raises(ValueError, match=r"main_process_port=\d+ is in use on this machine"):
            _check_port_free(busy.getsockname()[1])
