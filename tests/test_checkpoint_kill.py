"""SIGKILL during save_checkpoint, at random moments: the latest checkpoint is always whole.

A forked child (torch already imported, so each trial is quick) saves numbered checkpoints in
a loop, blocking and in the background, with rotation; the parent kills it at a random moment
and checks that `latest_checkpoint` names a checkpoint that loads, passes every checksum and
holds the values of the step it is named after.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from tests.processes import kill_while_busy

CTX = RunContext.single()
TRIALS = 20


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
    accel.latest_checkpoint(root)  # for a store's root: its client is made before the kill
    step = first_step
    ready.set()
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        accel.save_checkpoint(CTX, root, {"model": model, "optimizer": opt}, step=step,
                              keep=1, blocking=blocking)  # fmt: skip
        step += 1


def latest_loads_exactly(root: str | Path) -> int:
    """The step of `root`'s latest checkpoint, after checking it loads (every checksum) with
    the values its saver gave the model at that step."""
    latest = accel.latest_checkpoint(root)
    assert latest is not None
    step = int(str(latest).rsplit("step-", 1)[1])
    model = _model(-1.0)
    manifest = accel.load_state(CTX, latest, model=model)  # verifies every checksum
    assert manifest["step"] == step
    assert all(bool((p == float(step)).all()) for p in model.parameters())
    return step


@pytest.mark.slow
def test_sigkill_during_save_always_leaves_a_complete_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    accel.save_checkpoint(CTX, root, {"model": _model(0.0)}, step=0)
    rng = random.Random(0)
    next_step = 1
    latest_steps = []
    for trial in range(TRIALS):
        # a save takes a few milliseconds: many are in flight at the kill
        kill_while_busy(_saver, (str(root), next_step, trial % 2 == 0), rng.uniform(0.0, 0.2))
        step = latest_loads_exactly(root)
        latest_steps.append(step)
        next_step = step + 1000  # distinct names for the next child's saves
    assert len(set(latest_steps)) > 1  # some kills landed after a save had published
