"""Guards every test: no process group or environment variable may outlive a test.

Also marks every test in tests/dist and tests/cli `slow`: each starts processes (`run_world`
ranks, `accel` commands), seconds apiece, so `make test-fast` (`-m "not slow"`) leaves them out.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch.distributed as dist

from tests.env_guard import leaked

if TYPE_CHECKING:
    from tests.slurm_cluster import Cluster

# The S3-compatible server (one per session) and its per-test bucket, for the object-storage tests.
pytest_plugins = ["tests.s3_server", "tests.gcs_server"]

PROCESS_FOLDERS = frozenset({"dist", "cli"})  # under tests/: every test there starts processes


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.parent.parent == here and item.path.parent.name in PROCESS_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    before = dict(os.environ)
    yield
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    changed = leaked(before, os.environ)  # tests/env_guard.py: what torch sets is no leak
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    assert not leaked_group, "the test left a torch.distributed process group initialised"
    assert not changed, f"the test changed environment variables {sorted(changed)}"


@pytest.fixture(scope="session")
def slurm() -> Iterator[Cluster]:
    """A real one-node SLURM cluster for the session (tests/slurm_cluster.py); skipped, with
    the reason, where Debian's slurm-wlm and munge are not installed."""
    from tests.slurm_cluster import missing, slurm_cluster

    if absent := missing():
        pytest.skip(
            f"SLURM is not installed here ({', '.join(absent)} not found); `make "
            "cluster-engines` installs Debian's slurm-wlm and munge where apt is available"
        )
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster runs its daemons as root (SlurmUser=root)")
    # a short path: munged's socket lives there (a Unix socket path has at most 107 bytes)
    with (
        tempfile.TemporaryDirectory(prefix="accel-slurm-") as root,
        slurm_cluster(Path(root) / "cluster") as cluster,
    ):
        yield cluster
