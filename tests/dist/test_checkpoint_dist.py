"""Checkpoints across processes: DDP, FSDP2 resharding between world sizes, exact resume.

Each `run_world` is a fresh set of processes, so "resumed in a new process" is literal here.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accel
from accel import PerRank, RunContext
from accel._safetensors.header import CorruptFileError
from accel.testing import run_world

pytestmark = pytest.mark.dist

TIMEOUT = 120


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model)
    return model


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model(torch.randn(3, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state, keyed by parameter name, on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    msd = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    osd = get_optimizer_state_dict(model, opt, options=options)["state"]
    return msd, {k: {n: t.clone() for n, t in v.items()} for k, v in osd.items()}


def _fsdp_save(ctx: RunContext, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model = _fsdp(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_steps(model, opt, 2 + ctx.world_size, ctx.rank)
    accel.save_state(ctx, directory, model=model, optimizer=opt)
    return _full(model, opt)


def _fsdp_load(ctx: RunContext, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model = _fsdp(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    accel.load_state(ctx, directory, model=model, optimizer=opt)
    return _full(model, opt)


class Grads:
    """The gradients accumulated so far (they differ per rank under DDP no_sync)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, p in self.model.named_parameters():
            p.grad = None if state[n] is None else state[n].clone()


def _ddp_checks(ctx: RunContext, tmp: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_steps(model, opt, 2, ctx.rank)
    with model.no_sync():  # local gradients: different on each rank
        model(torch.full((1, 4), float(ctx.rank + 1))).sum().backward()
    accel.set_seed(5, ctx=ctx)
    accel.save_state(ctx, f"{tmp}/ddp", model=model, optimizer=opt, grads=PerRank(Grads(model)))
    after_save = torch.rand(2)
    model2 = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    accel.load_state(ctx, f"{tmp}/ddp", model=model2, optimizer=opt2, grads=PerRank(Grads(model2)))
    pairs = list(zip(model.parameters(), model2.parameters(), strict=True))
    return {
        "rng": torch.equal(torch.rand(2), after_save),
        "params": all(torch.equal(a, b) for a, b in pairs),
        "grads": all(torch.equal(a.grad, b.grad) for a, b in pairs),
        "grad0": model2.module[0].bias.grad.clone(),
        "momentum": all(
            torch.equal(opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"])
            for a, b in pairs
        ),
    }


def _world_two(ctx: RunContext, tmp: str) -> dict[str, Any]:
    ddp = _ddp_checks(ctx, tmp)
    saved_at_2 = _fsdp_save(ctx, f"{tmp}/fsdp2")
    loaded_from_1 = _fsdp_load(ctx, f"{tmp}/fsdp1")
    accel.save_model(ctx, _fsdp_load_model(ctx, f"{tmp}/fsdp2"), f"{tmp}/hf", full_state_dict=True)
    into_fsdp = _fsdp(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    accel.load_checkpoint_in_model(into_fsdp, f"{tmp}/hf")  # full weights into FSDP2 shards
    hf_into_fsdp = _full(into_fsdp, torch.optim.SGD(into_fsdp.parameters(), lr=0.1))[0]
    # A background save at 2 ranks: rank 0 publishes once both ranks' files are written.
    handle = accel.save_checkpoint(ctx, f"{tmp}/async", {"model": _mlp()}, step=4, blocking=False)
    handle.wait()
    dist.barrier()
    latest = accel.latest_checkpoint(f"{tmp}/async")
    return {
        "ddp": ddp,
        "saved_at_2": saved_at_2,
        "loaded_from_1": loaded_from_1,
        "hf_into_fsdp": hf_into_fsdp,
        "latest": None if latest is None else latest.name,
    }


def _fsdp_load_model(ctx: RunContext, directory: str) -> nn.Module:
    model = _fsdp(_mlp())
    accel.load_state(ctx, directory, model=model)
    return model


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_ddp_per_rank_state_and_fsdp2_across_world_sizes(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    (saved_at_1,) = run_world(_fsdp_save, world_size=1, timeout=TIMEOUT, args=(f"{tmp}/fsdp1",))
    results = run_world(_world_two, world_size=2, timeout=TIMEOUT, args=(tmp,))
    for r in results:
        assert r["ddp"]["rng"] and r["ddp"]["params"] and r["ddp"]["grads"]
        assert r["ddp"]["momentum"]
        _assert_same(r["loaded_from_1"][0], saved_at_1[0])  # saved at 1 rank, loaded at 2
        _assert_same(r["loaded_from_1"][1], saved_at_1[1])
        _assert_same(r["saved_at_2"][0], results[0]["saved_at_2"][0])
    assert [r["latest"] for r in results] == ["step-4", "step-4"]
    for r in results:
        _assert_same(r["hf_into_fsdp"], results[0]["saved_at_2"][0])
    assert sorted(p.name for p in (tmp_path / "async" / "step-4" / "rng").iterdir()) == [
        "rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors",
    ]  # fmt: skip
    # The per-rank gradients came back to their own rank: rank r's input was r + 1.
    assert not torch.equal(results[0]["ddp"]["grad0"], results[1]["ddp"]["grad0"])
    # Saved at 2 ranks, loaded in one plain process (no process group, no FSDP2).
    full_model, full_opt = results[0]["saved_at_2"]
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    accel.load_state(RunContext.single(), f"{tmp}/fsdp2", model=model, optimizer=opt)
    _assert_same(dict(model.state_dict()), full_model)
    for name, p in model.named_parameters():
        _assert_same(opt.state[p], full_opt[name])
    # save_model gathered the FSDP2 model to full weights, in the Hugging Face layout.
    hf = _mlp()
    accel.load_checkpoint_in_model(hf, f"{tmp}/hf")
    _assert_same(dict(hf.state_dict()), full_model)
    # A flipped byte in a DCP shard is refused as any other checkpoint file is, before loading.
    shard = sorted((tmp_path / "fsdp2" / "dcp").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=re.escape(repr(str(shard))) + " fails its checksum"):
        accel.load_state(RunContext.single(), f"{tmp}/fsdp2", model=_mlp())


# ------------------------------------------------------------------------ exact resume

N = 48
MICRO = 4  # samples per rank per micro-step
ACCUM = 3
EPOCHS = 2


class Progress:
    """Where the loop is: epoch, micro-step in the epoch, and this epoch's shuffled order."""

    def __init__(self) -> None:
        self.epoch, self.i, self.order = 0, 0, torch.empty(0, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "i": self.i, "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.i, self.order = state["epoch"], state["i"], state["order"].clone()


def train(ctx: RunContext, root: str, stop_at: int | None, resume: bool) -> dict[str, Any]:
    """A plain loop: shuffling from a seeded generator, dropout, accumulation, DDP at 2 ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    data_g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=data_g), torch.randn(N, 1, generator=data_g)
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    model = DDP(inner) if ctx.world_size > 1 else inner
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    shuffle = torch.Generator().manual_seed(42)
    progress = Progress()
    accel.set_seed(7, ctx=ctx)  # dropout differs per rank
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "shuffle": shuffle,
               "progress": progress, "grads": PerRank(Grads(inner))}  # fmt: skip
    t = 0
    if resume:
        manifest = accel.load_state(ctx, accel.latest_checkpoint(root), **objects)
        t = manifest["step"]
    losses = []
    per_epoch = N // (MICRO * ctx.world_size)
    while progress.epoch < EPOCHS:
        if progress.i == 0:
            progress.order = torch.randperm(N, generator=shuffle)
        mine = progress.order[ctx.rank :: ctx.world_size]
        while progress.i < per_epoch:
            idx = mine[progress.i * MICRO : (progress.i + 1) * MICRO]
            sync = (t + 1) % ACCUM == 0
            no_sync = model.no_sync() if isinstance(model, DDP) and not sync else nullcontext()
            with no_sync:
                loss = F.mse_loss(model(x[idx]), y[idx]) / ACCUM
                loss.backward()
            losses.append(loss.item())
            if sync:
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            t += 1
            progress.i += 1
            if t == stop_at:  # the "crash": save, then stop without finishing
                accel.save_checkpoint(ctx, root, objects, step=t, keep=1)
                return {"losses": losses}
        progress.epoch, progress.i = progress.epoch + 1, 0
    if ctx.world_size > 1:
        dist.barrier()
    return {"losses": losses, "params": [p.detach().clone() for p in inner.parameters()]}


def _first_run(ctx: RunContext, root: str, stop_at: int) -> list[dict[str, Any]]:
    return [train(ctx, f"{root}/ref", None, False), train(ctx, root, stop_at, False)]


@pytest.mark.parametrize(("world_size", "stop_at"), [(1, 17), (2, 8)])
def test_exact_resume_in_a_new_process(tmp_path: Path, world_size: int, stop_at: int) -> None:
    per_epoch = N // (MICRO * world_size)
    assert stop_at % ACCUM != 0 and stop_at % per_epoch != 0  # inside a window and an epoch
    first = run_world(_first_run, world_size=world_size, timeout=TIMEOUT,
                      args=(str(tmp_path), stop_at))  # fmt: skip
    resumed = run_world(train, world_size=world_size, timeout=TIMEOUT,
                        args=(str(tmp_path), None, True))  # fmt: skip
    for rank in range(world_size):
        reference, interrupted = first[rank]
        assert len(reference["losses"]) == EPOCHS * per_epoch
        assert interrupted["losses"] + resumed[rank]["losses"] == reference["losses"]  # bitwise
        for a, b in zip(resumed[rank]["params"], reference["params"], strict=True):
            assert torch.equal(a, b)


def _only_rank_zero_saves(ctx: RunContext, root: str) -> str:
    if ctx.rank == 1:
        return "rank 1 never saves"  # and leaves: rank 0's save is waiting on a dead peer
    try:
        accel.save_checkpoint(ctx, root, {"model": _mlp()}, step=1)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_rank_missing_from_a_save_is_named_by_the_call(tmp_path: Path) -> None:
    results = run_world(_only_rank_zero_saves, world_size=2, timeout=TIMEOUT, args=(str(tmp_path),))
    assert results[0].startswith("save_checkpoint: collective"), results[0]
    assert accel.latest_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the failed save left no staging folder


def _save_failing_on_rank_one(ctx: RunContext, root: str, blocking: bool) -> str:
    import errno

    from accel.checkpoint import _state_io

    model = _mlp()
    accel.save_checkpoint(ctx, root, {"model": model}, step=1).wait()  # the one to keep
    if ctx.rank == 1:  # this rank's disk fills up

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        _state_io.start_write = full  # type: ignore[assignment]
    try:
        accel.save_checkpoint(ctx, root, {"model": model}, step=2, blocking=blocking).wait()
    except (OSError, RuntimeError) as err:
        cause = err.__cause__ if isinstance(err, RuntimeError) and err.__cause__ else err
        return f"{getattr(cause, 'errno', None)} {cause}"
    return "saved"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_rank_failing_to_write_fails_save_state_promptly_on_every_rank(
    tmp_path: Path, blocking: bool
) -> None:
    # Rank 1 cannot write its files. Rank 0 must stop waiting for them (before: it waited for
    # rank 1's marker until the timeout, rank 1 having removed the shared staging folder), no
    # rank may return from a blocking save that was not published, and step 1 stays whole.
    results = run_world(_save_failing_on_rank_one, world_size=3, timeout=60,
                        args=(str(tmp_path), blocking))  # fmt: skip
    assert results[1].startswith("28 ") and str(tmp_path) in results[1], results
    assert results[0].startswith("28 ") and "rank 1" in results[0], results
    if blocking:  # rank 2 wrote its files; it learns of the failure in the closing barrier
        assert results[2].startswith("28 ") and "rank 1" in results[2], results
    else:  # "durable" on rank 2 means its own files written (documented)
        assert results[2] == "saved", results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no staging left
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accel.load_state(RunContext.single(), tmp_path / "step-1", model=model)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), _mlp().parameters(), strict=True)
    )
