"""Guards every test: no process group or environment variable may outlive a test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch._dynamo  # noqa: F401  (imported once here: its import sets TORCHINDUCTOR_CACHE_DIR)
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    before = dict(os.environ)
    yield
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    changed = {
        k
        for k in before.keys() | os.environ.keys()
        if before.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"  # pytest's own
    }
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    assert not leaked_group, "the test left a torch.distributed process group initialised"
    assert not changed, f"the test changed environment variables {sorted(changed)}"
