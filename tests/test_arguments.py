"""Bad arguments to the public API: one clear error naming the argument, its value and the rule.

Each case was accepted silently (failing later, far from the call) or answered with an error
that named neither the argument nor what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel
from accel import RunContext
from accel.testing import run_world

CTX = RunContext.single()


def _loader() -> DataLoader[Any]:
    return DataLoader(list(range(8)), batch_size=2)


CASES: dict[str, tuple[Callable[[Path], Any], type[Exception], str]] = {
    "init_distributed_seed_str": (
        lambda _: accel.init_distributed(device="cpu", seed="x"), TypeError, "seed='x'"
    ),
    "init_distributed_seed_negative": (
        lambda _: accel.init_distributed(device="cpu", seed=-1), ValueError, "seed=-1"
    ),
    "init_distributed_timeout_nan": (
        lambda _: accel.init_distributed(device="cpu", timeout=float("nan")),
        ValueError, "timeout=nan",
    ),
    "set_seed_too_large": (lambda _: accel.set_seed(2**70), ValueError, f"seed={2**70}"),
    "shard_loader_seed_str": (
        lambda _: accel.shard_loader(CTX, _loader(), seed="a"), TypeError, "seed='a'"
    ),
    "run_world_timeout_str": (
        lambda _: run_world(print, world_size=1, timeout="abc"), TypeError, "timeout='abc'"
    ),
    "save_checkpoint_state_list": (
        lambda p: accel.save_checkpoint(CTX, p, [nn.Linear(2, 2)], step=1), TypeError, "state="
    ),
    "save_model_model_str": (
        lambda p: accel.save_model(CTX, "model", p), TypeError, "model='model'"
    ),
    "load_checkpoint_in_model_model_str": (
        lambda p: accel.load_checkpoint_in_model("model", p), TypeError, "model='model'"
    ),
    "gather_str_at_world_size_1": (lambda _: accel.gather(CTX, "abc"), TypeError, "gather"),
    "pad_dim_out_of_range_at_world_size_1": (
        lambda _: accel.pad_across_processes(CTX, torch.ones(2), dim=5), ValueError, "dim=5"
    ),
    # Issue 29 item 7: each reached a bare Python error (or was accepted).
    "run_world_parallelism_str": (
        lambda _: run_world(print, world_size=2, parallelism="tp"), TypeError, "parallelism='tp'"
    ),
    "along_ctx_str": (lambda _: accel.along("x", "tp"), TypeError, "ctx='x'"),
    "parallelism_resolve_world_size_str": (
        lambda _: accel.Parallelism(tp=-1).resolve("4"), TypeError, "world_size='4'"
    ),
    "save_checkpoint_root_none": (
        lambda _: accel.save_checkpoint(CTX, None, {"model": nn.Linear(2, 2)}, step=1),
        TypeError, "root=None",
    ),
    "latest_checkpoint_root_none": (
        lambda _: accel.latest_checkpoint(None), TypeError, "root=None"
    ),
    "run_context_negative_timeout": (
        lambda _: RunContext(timeout=timedelta(seconds=-5)), ValueError,
        f"timeout={timedelta(seconds=-5)!r}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_argument_is_named_with_its_value(tmp_path: Path, case: str) -> None:
    call, kind, named = CASES[case]
    with pytest.raises(kind, match=re.escape(named)) as info:
        call(tmp_path)
    message = str(info.value)
    assert re.match(r"^[A-Za-z_.]+: ", message), f"the error does not name the call: {message}"
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_save_model_onto_a_file_names_it_and_leaves_it_alone(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"the user's file")
    with pytest.raises(NotADirectoryError, match=r"^save_model: directory=.*weights.*is a file"):
        accel.save_model(CTX, nn.Linear(2, 2), path)
    assert path.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]
