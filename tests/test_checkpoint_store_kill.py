"""SIGKILL during uploads to an S3 server, at random moments: the latest committed step loads.

The store has no rename, so a step is committed only by its manifest, written last. A forked
child saves numbered checkpoints to s3:// in a loop (blocking and in the background, keep=1)
and the parent kills it at a random moment, mostly while it uploads. After every kill,
`latest_checkpoint` must name a step that loads, passes every checksum and holds the values of
the step it is named after; and every step committed before the kill that rotation had no
reason to delete is still there (nothing lost). The last save then sweeps what the killed
uploads left: no half-written step, no record, remains.
"""

from __future__ import annotations

import random

import pytest
import torch

import accel
from accel import RunContext
from tests.processes import kill_while_busy
from tests.test_checkpoint_kill import _model, _saver, latest_loads_exactly
from tests.test_checkpoint_store import _objects

CTX = RunContext.single()
TRIALS = 20
pytestmark = pytest.mark.slow


def _committed(s3: str) -> set[str]:
    return {k.split("/")[1] for k in _objects(s3) if k.endswith("/accel-manifest.json")}


def test_sigkill_during_uploads_always_leaves_a_committed_latest(s3: str) -> None:
    root = f"{s3}/run"
    accel.save_checkpoint(CTX, root, {"model": _model(0.0)}, step=0)
    # The first optimizer a process makes imports torch._dynamo (seconds): made here, before
    # the forks, each child's takes no time and the kills land during its saves.
    torch.optim.SGD(_model(0.0).parameters(), lr=0.1)
    rng = random.Random(0)
    next_step = 1
    latest_steps = []
    for trial in range(TRIALS):
        before = _committed(s3)
        # a save takes tens of milliseconds here: most kills land during its uploads
        kill_while_busy(_saver, (root, next_step, trial % 2 == 0), rng.uniform(0.0, 0.4))
        step = latest_loads_exactly(root)
        # Nothing lost: what was committed before is still committed, unless a newer commit
        # made rotation (keep=1) delete it.
        after = _committed(s3)
        assert before <= after or max(int(s.removeprefix("step-")) for s in after) > max(
            int(s.removeprefix("step-")) for s in before
        )
        latest_steps.append(step)
        next_step = step + 1000  # distinct names for the next child's saves
    assert len(set(latest_steps)) > 1  # some kills landed after a save had committed
    # The next save sweeps every half-written step and record the kills left.
    accel.save_checkpoint(CTX, root, {"model": _model(7.0)}, step=next_step, keep=1)
    left = _objects(s3)
    assert _committed(s3) == {f"step-{next_step}"}
    assert {k.split("/")[1] for k in left} == {f"step-{next_step}"}
    assert not [k for k in left if "/.accel-" in k]
