"""A Google Cloud Storage emulator on 127.0.0.1 for the tests, reached as a user reaches one.

One `gcp-storage-emulator` server (a `dev` dependency, in memory) serves the whole session in a
process of its own; each test gets its own bucket. gcsfs finds it the way a user points it at an
emulator: `STORAGE_EMULATOR_HOST`, with anonymous credentials given through fsspec's
configuration variables (`FSSPEC_GS_TOKEN=anon`), read by gcsfs and fsspec, not by accel.
Ranks started by `run_world` inherit the variables.

`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` is set for the whole session, when pytest loads this
plugin: gcsfs reads it once, at its import, and otherwise asks each bucket's layout of the
storage control API (gRPC), which the emulator does not serve (each ask waits 60 s, then falls
back to the plain client this setting selects at once).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.s3_server import make_bucket

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def gcs_environment(endpoint: str) -> dict[str, str]:
    """The variables a user sets to use a GCS emulator at `endpoint`."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "FSSPEC_GS_TOKEN": "anon",
        "FSSPEC_GS_PROJECT": "accel-test",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's GCS emulator, started once: its endpoint URL."""
    pytest.importorskip("gcsfs")  # the `gcs` extra, in `dev`: a bare install may lack it
    pytest.importorskip("gcp_storage_emulator")
    port = _free_port()
    log = tmp_path_factory.mktemp("gcs") / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(port), "--in-memory"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the GCS emulator did not start: {log.read_text()}"
                    ) from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def gs(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket (its URL) on the session's emulator, with the variables that point gcsfs at
    it set for the test (and the ranks it starts)."""
    for key, value in gcs_environment(gcs_endpoint).items():
        monkeypatch.setenv(key, value)
    return make_bucket("gs")
