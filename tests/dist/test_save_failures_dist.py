"""A rank whose part of a save fails: every rank raises the same error, naming that rank.

One world of two ranks runs each save path in turn with one rank's disk "full" (its write
raising ENOSPC); each rank reports the error it raised, and the test compares them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from accel.testing import run_world

pytestmark = pytest.mark.dist


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _fsdp2() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _full(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@contextmanager
def _patched(owner: Any, name: str, value: Any, on: bool) -> Iterator[None]:
    """Replace `owner.name` with `value` while the block runs (on this rank only when `on`)."""
    old = getattr(owner, name)
    if on:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _outcome(save: Callable[[], Any]) -> str:
    try:
        save()
    except Exception as err:
        return f"{type(err).__name__} errno={getattr(err, 'errno', None)}: {err}"
    return "saved"


def _each_save_path(ctx: RunContext, root: str) -> dict[str, str]:
    from accel.checkpoint import _model_io, _sharded_save, _state_io

    top = Path(root)
    results = {}
    with _patched(_state_io, "start_write", _full, ctx.rank == 1):
        results["save_state"] = _outcome(lambda: accel.save_state(ctx, top / "s", m=_mlp()))
        results["save_checkpoint"] = _outcome(
            lambda: accel.save_checkpoint(ctx, top / "c", {"m": _mlp()}, step=1)
        )
        sharded = _fsdp2()  # its DCP files are written; rank 1's RNG file is not
        results["save_state fsdp2"] = _outcome(lambda: accel.save_state(ctx, top / "f", m=sharded))
    sharded = _fsdp2()
    with _patched(os, "pwrite", _full, ctx.rank == 1):  # rank 1 writes its slices in place
        results["save_model sharded"] = _outcome(lambda: accel.save_model(ctx, sharded, top / "m"))
    with _patched(_sharded_save, "presize", _full, ctx.is_main):  # rank 0 creates the files
        results["save_model create"] = _outcome(lambda: accel.save_model(ctx, sharded, top / "m"))
    # rank 0 writes the journal that decides the export (its manifest and the files it replaces)
    with _patched(_model_io, "write_journal", _full, ctx.is_main):
        results["save_model publish"] = _outcome(lambda: accel.save_model(ctx, sharded, top / "m"))
    not_shared = lambda *args: (False, [])  # noqa: E731  # as if each rank had its own disk
    with (
        _patched(_sharded_save, "_survey", not_shared, True),
        _patched(os, "pwrite", _full, ctx.is_main),  # rank 0 writes what is streamed to it
    ):
        results["save_model streamed"] = _outcome(lambda: accel.save_model(ctx, sharded, top / "m"))
    return results


def test_a_failing_rank_fails_every_save_path_alike_on_every_rank(tmp_path: Path) -> None:
    results = run_world(_each_save_path, world_size=2, timeout=120, args=(str(tmp_path),))
    failing = {"save_model create": 0, "save_model publish": 0, "save_model streamed": 0}
    for path, mine in results[0].items():
        theirs = results[1][path]
        assert mine == theirs, (path, mine, theirs)  # the same type, errno and message
        assert mine.startswith(f"OSError errno={errno.ENOSPC}:"), (path, mine)
        assert f"rank {failing.get(path, 1)}" in mine, (path, mine)
        assert str(tmp_path) in mine, (path, mine)  # it names the folder
    assert sorted(results[0]) == sorted(results[1]) and len(results[0]) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "m"]  # nothing else published
    assert list((tmp_path / "c").iterdir()) == []  # no checkpoint, no staging folder
    assert not any(p.name.startswith(".") for p in (tmp_path / "m").iterdir())  # no partials


def _unsharded_save_failing_on_main(ctx: RunContext, root: str, where: str) -> str:
    from accel.checkpoint import _model_io

    if where == "save_state":  # rank 0 cannot create the staging folder
        with _patched(Path, "mkdir", _full, ctx.is_main):
            return _outcome(lambda: accel.save_state(ctx, Path(root) / "s", m=_mlp()))
    with _patched(_model_io, "write_journal", _full, ctx.is_main):  # rank 0 decides the export
        return _outcome(lambda: accel.save_model(ctx, _mlp(), root))


@pytest.mark.parametrize("where", ["save_model", "save_state"])
def test_a_step_only_rank_zero_takes_fails_every_rank_instead_of_a_hang(
    tmp_path: Path, where: str
) -> None:
    # Before: rank 0 raised alone and rank 1 waited in the next collective until the timeout.
    results = run_world(_unsharded_save_failing_on_main, world_size=2, timeout=60,
                        args=(str(tmp_path), where))  # fmt: skip
    assert results[0] == results[1], results
    assert results[0].startswith(f"OSError errno={errno.ENOSPC}:") and "rank 0" in results[0]


def _save_again_while_rank_one_cleans_up(ctx: RunContext, root: str) -> dict[str, Any]:
    import time

    from accel.checkpoint import _sharded_save

    sharded, folder = _fsdp2(), Path(root) / "m"
    real_unlink = Path.unlink

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:
        time.sleep(1.0)  # rank 0 is presizing the next save's files meanwhile
        real_unlink(self, missing_ok=missing_ok)

    with (
        _patched(_sharded_save, "presize", _full, ctx.is_main),
        _patched(Path, "unlink", slow_unlink, ctx.rank == 1),
    ):
        first = _outcome(lambda: accel.save_model(ctx, sharded, folder))
    second = _outcome(lambda: accel.save_model(ctx, sharded, folder))
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    return {"first": first, "second": second, "full": full}


def test_a_save_retried_at_once_after_a_failure_is_not_undone_by_another_ranks_cleanup(
    tmp_path: Path,
) -> None:
    # Before: rank 1, still removing the failed save's partial files, removed the ones rank 0
    # had just created for the retry, which then failed with ENOENT.
    from safetensors.torch import load_file

    results = run_world(_save_again_while_rank_one_cleans_up, world_size=2, timeout=60,
                        args=(str(tmp_path),))  # fmt: skip
    for mine in results:
        assert mine["first"].startswith(f"OSError errno={errno.ENOSPC}:"), mine["first"]
        assert mine["second"] == "saved", mine["second"]
    saved = load_file(tmp_path / "m" / "model.safetensors")
    assert saved.keys() == results[0]["full"].keys()
    for name, value in results[0]["full"].items():
        assert torch.equal(saved[name], value), name
