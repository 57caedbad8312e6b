"""A real S3-compatible server on 127.0.0.1 for the tests, reached as a user reaches one.

One moto server (`ThreadedMotoServer`, the `moto[server]` test dependency) serves the whole
session; each test gets its own bucket. accel finds it the way a user points s3fs at a local
or private server: `AWS_ENDPOINT_URL` and the usual `AWS_*` credential variables, read by the
store's client (botocore), not by accel. Ranks started by `run_world` inherit them.

`FlakyProxy` stands between the client and the server as a bad network does: it answers the
first requests it gets with S3's 503 "SlowDown" and passes the rest through, or denies every
request from some moment on.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

import pytest


def _error_response(status: str, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_SLOW_DOWN = _error_response("503 Slow Down", "SlowDown", "Please reduce your request rate.")
_DENIED = _error_response("403 Forbidden", "AccessDenied", "Access Denied")


def s3_environment(endpoint: str) -> dict[str, str]:
    """The variables a user sets to use an S3-compatible server at `endpoint`."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "accel-test-key",
        "AWS_SECRET_ACCESS_KEY": "accel-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The session's S3 server, started once: its endpoint URL."""
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")  # the server logs each request otherwise
    level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        werkzeug.setLevel(level)


def fresh_clients() -> None:
    """Forget the s3fs clients made so far (fsspec caches one per set of options), so that the
    next one reads the variables as they are now."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def make_bucket(protocol: str = "s3") -> str:
    """A new, empty bucket on the server the variables name for `protocol`; its URL."""
    import fsspec

    name = f"accel-{secrets.token_hex(6)}"
    fsspec.filesystem(protocol).mkdir(name)
    return f"{protocol}://{name}"


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket (its URL) on the session's server, with the variables that point s3fs at it
    set for the test (and the ranks it starts). The client s3fs caches is kept between tests (a
    new one costs seconds of botocore's start-up): tests that change the variables call
    `fresh_clients()` before and after."""
    for key, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(key, value)
    return make_bucket()


class FlakyProxy(socketserver.ThreadingTCPServer):
    """A TCP proxy to `target` ("host:port") that answers its first `failures` connections with
    S3's 503 SlowDown and closes them, and passes later ones through; after `deny()` every
    request gets 403 AccessDenied (credentials that expired mid-run), open connections cut."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target: str, failures: int = 0) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.failures = failures
        self.lock = threading.Lock()
        self.refused = 0
        self.denying = False
        self.open: set[socket.socket] = set()
        super().__init__(("127.0.0.1", 0), _Relay)
        threading.Thread(target=self.serve_forever, name="flaky-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self) -> bytes | None:
        """The error this connection gets, or None to pass it through."""
        with self.lock:
            if self.denying:
                return _DENIED
            if self.refused < self.failures:
                self.refused += 1
                return _SLOW_DOWN
            return None

    def deny(self) -> None:
        with self.lock:
            self.denying = True
            for sock in self.open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Relay(socketserver.BaseRequestHandler):
    server: Any

    def handle(self) -> None:
        client: socket.socket = self.request
        error = self.server.answer()
        if error is not None:
            client.recv(65536)  # the request line and headers
            client.sendall(error)
            return
        upstream = socket.create_connection(self.server.target)
        with self.server.lock:
            self.server.open.update((client, upstream))
        pump = threading.Thread(target=_copy, args=(upstream, client), daemon=True)
        pump.start()
        _copy(client, upstream)
        pump.join()
        upstream.close()
        with self.server.lock:
            self.server.open.difference_update((client, upstream))


def _copy(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 20):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
