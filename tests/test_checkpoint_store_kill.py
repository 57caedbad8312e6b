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

import multiprocessing as mp
import os
import random
import signal
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from tests.test_checkpoint_store import _objects

CTX = RunContext.single()
TRIALS = 20
pytestmark = pytest.mark.slow


def _model(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))  # about 1 MB
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _saver(root: str, first_step: int, blocking: bool, ready: Any) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork: never touch it
    model = _model(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accel.latest_checkpoint(root)  # the store's client is made before the kills start
    step = first_step
    ready.set()
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        accel.save_checkpoint(CTX, root, {"model": model, "optimizer": opt}, step=step,
                              keep=1, blocking=blocking)  # fmt: skip
        step += 1


def _committed(s3: str) -> set[str]:
    return {k.split("/")[1] for k in _objects(s3) if k.endswith("/accel-manifest.json")}


def test_sigkill_during_uploads_always_leaves_a_committed_latest(s3: str) -> None:
    root = f"{s3}/run"
    accel.save_checkpoint(CTX, root, {"model": _model(0.0)}, step=0)
    # The first optimizer a process makes imports torch._dynamo (seconds): made here, before
    # the forks, each child's takes no time and the kills land during its saves.
    torch.optim.SGD(_model(0.0).parameters(), lr=0.1)
    rng = random.Random(0)
    fork = mp.get_context("fork")  # torch is imported already: each child starts at once
    next_step = 1
    latest_steps = []
    for trial in range(TRIALS):
        before = _committed(s3)
        ready = fork.Event()
        child = fork.Process(target=_saver, args=(root, next_step, trial % 2 == 0, ready))
        with warnings.catch_warnings():
            # Python >= 3.12 warns about forking a process with threads (torch's pool, the
            # store client's event loop); the child touches neither before it makes its own.
            warnings.simplefilter("ignore", DeprecationWarning)
            child.start()
        assert ready.wait(timeout=60)
        time.sleep(rng.uniform(0.0, 0.4))  # a save takes tens of milliseconds: many in flight
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        latest = accel.latest_checkpoint(root)
        assert latest is not None
        step = int(latest.rsplit("step-", 1)[1])
        model = _model(-1.0)
        manifest = accel.load_state(CTX, latest, model=model)  # checks every checksum
        assert manifest["step"] == step
        assert all(bool((p == float(step)).all()) for p in model.parameters())
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
