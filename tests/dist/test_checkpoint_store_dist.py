"""Checkpoints on object storage at 1, 2 and 4 ranks, against the session's S3 server.

Each layout (DDP, FSDP2, FSDP2 x TP on a 2x2 mesh) saves numbered checkpoints to s3://
(blocking, then in the background with rotation), loads the latest back, exports with
save_model and loads the export; every value is compared bit for bit with the full state the
ranks held when they saved (an independent reference: torch's own full state dicts). Resuming
at another world size and layout goes the same way: 1 -> 2 ranks (FSDP2), 2 -> 4 ranks (FSDP2
into FSDP2 x TP, DDP into DDP), 4 ranks -> one plain process; merge-weights and dispatch_checkpoint
read the 4-rank checkpoint and export from the store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from accel.testing import run_world
from tests.dist.test_sharded_io_dist import _fsdp2, _fsdp2_tp
from tests.models import Uneven

pytestmark = pytest.mark.dist

TIMEOUT = 180


class Net(Uneven):
    """tests.models.Uneven (uneven sizes, a tied pair) with a forward through every layer."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        y = self.head(self.norm(self.down(self.up(h))))
        return y.square().mean() + self.out(h).square().mean()


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net()


def _layout(kind: str, seed: int) -> nn.Module:
    model = _net(seed)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return _fsdp2_tp(model) if kind == "fsdp2xtp" else _fsdp2(model)


def _trained(kind: str, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _layout(kind, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    # Tensor-parallel peers (ranks 2k and 2k+1 of the 2x2 mesh) see the same batch.
    g = torch.Generator().manual_seed(10 + (rank // 2 if kind == "fsdp2xtp" else rank))
    model(torch.randint(0, 11, (5,), generator=g)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _full(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Every value of the model (and optimizer) as full tensors, by parameter name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    if opt is not None:
        state = get_optimizer_state_dict(model, opt, options=options)["state"]
        out.update({f"opt.{k}.{n}": t.clone() for k, v in state.items() for n, t in v.items()})
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_and_load(ctx: RunContext, s3: str, kind: str) -> dict[str, Any]:
    """Save, rotate, find, load and export `kind` at this world size; every check bit for bit."""
    ctx = dataclasses.replace(ctx, seed=0)
    model, opt = _trained(kind, ctx.rank)
    reference = _full(model, opt)
    root = f"{s3}/{kind}-{ctx.world_size}"
    state = {"model": model, "optimizer": opt}
    accel.save_checkpoint(ctx, root, state, step=1)
    accel.set_seed(5, ctx=ctx)
    handle = accel.save_checkpoint(ctx, root, state, step=2, keep=1, blocking=False)
    after_save = torch.rand(2)
    assert handle.wait() == f"{root}/step-2"
    accel.wait_for_everyone(ctx)  # rank 0 has committed (and rotated) once every rank waited
    latest = accel.latest_checkpoint(root)
    model2 = _layout(kind, seed=9)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    manifest = accel.load_state(ctx, latest, {"model": model2, "optimizer": opt2})
    rng = torch.equal(torch.rand(2), after_save)
    accel.save_model(ctx, model, f"{root}-hf", max_shard_size=200)
    exported = _layout(kind, seed=9)
    accel.load_checkpoint_in_model(exported, f"{root}-hf")
    return {
        "reference": reference,
        "latest": latest,
        "step": manifest["step"],
        "loaded": _equal(_full(model2, opt2), reference),
        "rng": rng,
        "exported": _equal(_full(exported), _full(model)),
    }


def _resume(ctx: RunContext, url: str, kind: str) -> dict[str, Any]:
    """Load a checkpoint saved at another world size (or layout) into `kind` here."""
    ctx = dataclasses.replace(ctx, seed=0)  # ranks the save did not have are seeded from it
    model = _layout(kind, seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    accel.load_state(ctx, url, {"model": model, "optimizer": opt})
    return _full(model, opt)


def _world_one(ctx: RunContext, s3: str) -> dict[str, Any]:
    return _save_and_load(ctx, s3, "fsdp2")


def _world_two(ctx: RunContext, s3: str) -> dict[str, Any]:
    return {
        "ddp": _save_and_load(ctx, s3, "ddp"),
        "fsdp2": _save_and_load(ctx, s3, "fsdp2"),
        "from_one": _resume(ctx, f"{s3}/fsdp2-1/step-2", "fsdp2"),
    }


def _world_four(ctx: RunContext, s3: str) -> dict[str, Any]:
    return {
        "fsdp2xtp": _save_and_load(ctx, s3, "fsdp2xtp"),
        "from_fsdp2": _resume(ctx, f"{s3}/fsdp2-2/step-2", "fsdp2xtp"),
        "from_ddp": _resume(ctx, f"{s3}/ddp-2/step-2", "ddp"),
    }


def _model_only(full: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in full.items() if k.startswith("model.")}


def test_every_checkpoint_function_round_trips_through_s3_at_1_2_and_4_ranks(s3: str) -> None:
    from accel.checkpoint._merge import merge_weights

    one = run_world(_world_one, world_size=1, timeout=TIMEOUT, args=(s3,))
    two = run_world(_world_two, world_size=2, timeout=TIMEOUT, args=(s3,))
    four = run_world(_world_four, world_size=4, timeout=TIMEOUT, args=(s3,))
    saves = [(1, one[0]), *[(2, r["ddp"]) for r in two], *[(2, r["fsdp2"]) for r in two]]
    saves += [(4, r["fsdp2xtp"]) for r in four]
    for world_size, result in saves:
        assert result["loaded"] and result["rng"] and result["exported"], (world_size, result)
        assert result["step"] == 2 and result["latest"].endswith(f"-{world_size}/step-2")
    for r in two:  # saved by 1 rank, resumed at 2
        assert _equal(r["from_one"], one[0]["reference"])
    for r in four:  # saved by 2 ranks, resumed at 4: FSDP2 as FSDP2 x TP, DDP as DDP
        assert _equal(r["from_fsdp2"], two[0]["fsdp2"]["reference"])
        assert _equal(r["from_ddp"], two[0]["ddp"]["reference"])
    # Saved by 4 ranks (FSDP2 x TP), resumed in one plain process with no process group.
    expected = four[0]["fsdp2xtp"]["reference"]
    model = _net(9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    accel.load_state(RunContext.single(), f"{s3}/fsdp2xtp-4/step-2", model=model, optimizer=opt)
    assert _equal(_full(model, opt), expected)
    # merge-weights from the store to the store, and dispatch_checkpoint of the export.
    merge_weights(f"{s3}/fsdp2xtp-4/step-2", f"{s3}/merged", max_shard_size=200)
    merged = Net()
    accel.load_checkpoint_in_model(merged, f"{s3}/merged")
    assert _equal(_full(merged), _model_only(expected))
    with accel.init_empty_weights():
        empty = Net()
    dispatched = accel.dispatch_checkpoint(empty, f"{s3}/fsdp2xtp-4-hf", device_map={"": "cpu"})
    assert _equal(_full(dispatched), _model_only(expected))


def _two_ranks(ctx: RunContext, url: str) -> dict[str, Any]:
    return {"ddp": _save_and_load(ctx, url, "ddp"), "fsdp2": _save_and_load(ctx, url, "fsdp2")}


def test_ddp_and_fsdp2_round_trip_through_gs_and_resume_in_one_process(gs: str) -> None:
    # The session's GCS emulator through gcsfs: the same saves as above at 2 ranks, then the
    # FSDP2 checkpoint resumed in one plain process.
    two = run_world(_two_ranks, world_size=2, timeout=TIMEOUT, args=(gs,))
    for r in two:
        for kind in ("ddp", "fsdp2"):
            result = r[kind]
            assert result["loaded"] and result["rng"] and result["exported"], (kind, result)
            assert result["latest"] == f"{gs}/{kind}-2/step-2" and result["step"] == 2
    model = _net(9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    accel.load_state(RunContext.single(), f"{gs}/fsdp2-2/step-2", model=model, optimizer=opt)
    assert _equal(_full(model, opt), two[0]["fsdp2"]["reference"])
