"""The GPU suite's sync counter (tests/gpu/plumbing.py) counts syncs, and only syncs: its
first count in a process read torch's one-time notice about the mode itself as a sync."""

from __future__ import annotations

from tests.gpu import plumbing

NOTICE = (  # torch's TORCH_WARN_ONCE in THCPModule_cudaSetSyncDebugMode (torch/csrc/cuda)
    "Synchronization debug mode is a prototype feature and does not yet detect all "
    "synchronizing operations"
)


def test_the_sync_counter_counts_torchs_sync_warnings_not_its_notice() -> None:
    assert plumbing.syncs_in([NOTICE]) == 0
    assert plumbing.syncs_in([NOTICE, plumbing.SYNC_WARNING, plumbing.SYNC_WARNING]) == 2
    assert plumbing.syncs_in(["an unrelated warning"]) == 0
