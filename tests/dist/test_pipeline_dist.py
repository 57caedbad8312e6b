"""Pipeline parallelism at 4 gloo ranks against a one-process full-batch reference (issue 27).

One world of 4 processes runs every case, each on its own DeviceMesh: pp=4 with gpipe, 1f1b,
interleaved_1f1b and zbv (several stages per rank), pp=2 x dp_shard=2 (FSDP2 per stage through
`wrap_model`) and pp=2 x tp=2 (tensor parallelism per stage). Each case trains the same
8-block Llama-style model for a few SGD steps with gradient clipping; the data comes through
`shard_loader`, which must shard over dp only (pp peers see the same batches; `num_items_in_batch`
and `gather_for_metrics` count each sample once). After the steps
every parameter equals the reference's within 1e-5 relative, the loss `pipeline_step` returns
on every rank (averaged over dp) equals the reference loss, and `clip_grad_norm_` returns the
whole model's norm on every rank. The same world saves a run at pp=2 x dp_shard=2 and resumes
it at pp=4 (its stages given their shapes up front with `example_inputs`); the test then
resumes it in one process: the per-step losses continue as the uninterrupted run's and the
parameters end equal.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accel
from accel import Parallelism
from accel._mesh import with_mesh
from accel.testing import run_world
from tests.models import TP_PLAN, batches, full_param, make_model

pytestmark = pytest.mark.dist

LAYERS, STEPS, GLOBAL_BATCH, LR, MAX_NORM = 8, 3, 8, 0.1, 0.5
RESUME_AT = 2  # the save / resume test saves after this many of the STEPS

CASES = (
    (Parallelism(pp=4), "gpipe", None, 4),
    (Parallelism(pp=4), "1f1b", None, 4),
    (Parallelism(pp=4), "interleaved_1f1b", None, 4),
    (Parallelism(pp=4), "zbv", None, 4),
    (Parallelism(pp=2, dp_shard=2), "1f1b", "fsdp2", 2),
    (Parallelism(pp=2, tp=2), "gpipe", "tp", 2),
)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference(data: torch.Tensor) -> dict[str, Any]:
    model = make_model(layers=LAYERS)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for tokens in data:
        loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def _train(ctx: accel.RunContext, parallelism: Parallelism, schedule: str, wrap: str | None,
           microbatches: int, data: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    world = dataclasses.replace(ctx, parallelism=None, mesh=None)
    ctx = with_mesh(world, parallelism, source="test")
    wrapper = None
    if wrap == "fsdp2":
        wrapper = lambda m: accel.wrap_model(ctx, m)  # noqa: E731
    elif wrap == "tp":
        wrapper = lambda m: accel.wrap_model(ctx, m, tp_plan=TP_PLAN)  # noqa: E731
    stages = accel.pipeline_stages(
        ctx, make_model(layers=LAYERS), loss_fn=token_loss, microbatches=microbatches,
        schedule=schedule, wrap=wrapper,  # type: ignore[arg-type]
    )  # fmt: skip
    # The warm-up sends torch makes before the first step: none to this rank itself (torch
    # 2.11's gloo fails on one: "Pair is not connected"; under zbv two stages share a rank).
    own = accel.along(ctx, "pp").rank
    schedule = stages.schedule
    torch_stages = getattr(schedule, "_stages", None) or [schedule._stage]
    self_sends = [
        op
        for stage in torch_stages
        for op in stage._get_init_p2p_neighbors_ops()
        if op.group_peer == own
    ]
    optimizer = torch.optim.SGD(stages.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(data.flatten(0, 1), batch_size=GLOBAL_BATCH // ctx.dp_size)
    losses, norms, counts, seen = [], [], [], []
    sharded = accel.shard_loader(ctx, loader)
    for tokens in sharded:
        counts.append(accel.num_items_in_batch(ctx, [tokens], shift=True))
        seen.append(accel.gather_for_metrics(ctx, tokens, loader=sharded))
        loss = accel.pipeline_step(ctx, stages, tokens[:, :-1], tokens[:, 1:])
        norms.append(accel.clip_grad_norm_(ctx, stages.parameters(), MAX_NORM).item())
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
        losses.append(accel.reduce(accel.along(ctx, "dp"), loss, op="mean").item())
    params = {
        name: full_param(q)
        for module in stages.modules
        for name, q in accel.unwrap_model(module).named_parameters()
    }
    return {"losses": losses, "norms": norms, "params": params, "stages": stages.stage_ids,
            "counts": counts, "seen": seen, "self_sends": len(self_sends)}  # fmt: skip


def _resume_part(ctx: accel.RunContext, parallelism: Parallelism, data: torch.Tensor,
                 folder: str, save: bool) -> dict[str, Any]:  # fmt: skip
    """Train on `data` at `parallelism`: from scratch then save, or loaded from `folder`."""
    ctx = with_mesh(dataclasses.replace(ctx, parallelism=None, mesh=None), parallelism,
                    source="test")  # fmt: skip
    wrapper = (lambda m: accel.wrap_model(ctx, m)) if parallelism.dp_shard > 1 else None
    # Resumed with the stages' shapes given up front (found here from one microbatch), saved
    # without: both train as the one-process reference.
    example = None if save else data[0, : GLOBAL_BATCH // ctx.dp_size // 4, :-1]
    stages = accel.pipeline_stages(ctx, make_model(layers=LAYERS), loss_fn=token_loss,
                                   microbatches=4, wrap=wrapper,
                                   example_inputs=example)  # fmt: skip
    optimizer = torch.optim.SGD(stages.parameters(), lr=LR, momentum=0.9)
    if not save:
        accel.load_state(ctx, folder, model=stages.model, optimizer=optimizer)
    losses = []
    for tokens in data:
        part = tokens.chunk(ctx.dp_size)[ctx.dp_rank]
        loss = accel.pipeline_step(ctx, stages, part[:, :-1], part[:, 1:])
        accel.clip_grad_norm_(ctx, stages.parameters(), MAX_NORM)
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
        losses.append(accel.reduce(accel.along(ctx, "dp"), loss, op="mean").item())
    if save:
        accel.save_state(ctx, folder, model=stages.model, optimizer=optimizer)
    return {"losses": losses, "params": {n: full_param(q)
                                         for n, q in stages.model.named_parameters()}}  # fmt: skip


def _whole_world(ctx: accel.RunContext, data: torch.Tensor, folder: str) -> dict[str, Any]:
    cases = [_train(ctx, *case, data) for case in CASES]
    first, second = data[:RESUME_AT], data[RESUME_AT:]
    saved = _resume_part(ctx, Parallelism(pp=2, dp_shard=2), first, folder, save=True)
    resumed = _resume_part(ctx, Parallelism(pp=4), second, folder, save=False)
    return {"cases": cases, "saved": saved, "resumed": resumed}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 4-rank world runs every case and the save / resume (spawning costs the most)."""
    data = batches(STEPS, GLOBAL_BATCH)
    folder = tmp_path_factory.mktemp("pipeline") / "state"
    results = run_world(_whole_world, world_size=4, args=(data, str(folder)), timeout=600)
    return {"data": data, "folder": folder, "results": results}


@pytest.mark.slow
def test_every_mesh_and_schedule_trains_as_one_process_on_the_full_batch(
    world: dict[str, Any],
) -> None:
    data = world["data"]
    expected = _reference(data)
    results = [per_rank["cases"] for per_rank in world["results"]]
    for c, (parallelism, schedule, *_) in enumerate(CASES):
        case = f"{parallelism} {schedule}"
        outs = [per_rank[c] for per_rank in results]
        for out in outs:  # every rank gets the loss and the whole model's norm
            assert out["self_sends"] == 0, case
            # pp peers share batches: counts and gathered samples are the global batch's, once
            assert out["counts"] == [GLOBAL_BATCH * (data.shape[-1] - 1)] * STEPS, case
            assert all(torch.equal(a, b) for a, b in zip(out["seen"], data, strict=True)), case
            assert out["losses"] == pytest.approx(expected["losses"], rel=1e-5), case
            assert out["norms"] == pytest.approx(expected["norms"], rel=1e-5), case
        names: set[str] = set()
        for out in outs:  # every rank's stage(s), dp and tp peers included
            names |= out["params"].keys()
            for name, value in out["params"].items():
                want = expected["params"][name].detach()
                torch.testing.assert_close(
                    value, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, c=case: f"{c} {n}: {m}"
                )
        assert names == expected["params"].keys(), case
    stage_ids = [per_rank[3]["stages"] for per_rank in results]  # zbv: the V shape
    assert stage_ids == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.slow
def test_saved_at_pp2_x_dp_shard2_resumes_at_pp4_and_in_one_process(
    world: dict[str, Any],
) -> None:
    data, folder = world["data"], world["folder"]
    expected = _reference(data)
    for out in world["results"]:  # every rank: the losses of the uninterrupted run
        assert out["saved"]["losses"] == pytest.approx(expected["losses"][:RESUME_AT], rel=1e-5)
        assert out["resumed"]["losses"] == pytest.approx(expected["losses"][RESUME_AT:], rel=1e-5)
        for name, value in out["resumed"]["params"].items():
            want = expected["params"][name].detach()
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)
    # One process: the whole model, by the same names, from the same checkpoint.
    ctx = accel.RunContext.single(device="cpu")
    model = make_model(seed=7, layers=LAYERS)  # other weights: the checkpoint must replace them
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    accel.load_state(ctx, folder, model=model, optimizer=optimizer)
    losses = []
    for tokens in data[RESUME_AT:]:
        loss = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(expected["losses"][RESUME_AT:], rel=1e-5)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), expected["params"][name].detach(), rtol=1e-5,
                                   atol=1e-6, msg=name)  # fmt: skip


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the first stage finishes its step well after the last."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.5)
        return grad


class _Slow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def _last_step_then_leave(ctx: accel.RunContext, end: str) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Slow(), torch.nn.Linear(8, 1))
    stages = accel.pipeline_stages(ctx, model, loss_fn=F.mse_loss, microbatches=2,
                                   split_points=("2",))  # fmt: skip
    loss = accel.pipeline_step(ctx, stages, torch.ones(4, 4), torch.zeros(4, 1))
    if end == "shutdown":
        accel.shutdown(ctx)
    return loss.item()  # "return": run_world's rank ends its group, as a script's exit does


@pytest.mark.parametrize("end", ["return", "shutdown"])
def test_the_last_stage_leaving_right_after_the_last_step_loses_no_loss(end: str) -> None:
    # The estimate test's calibration failed so in a fresh-clone CI run: the last stage sends
    # the loss without waiting, and its rank ended the group while the send was in flight; the
    # first stage, still in its last backward, read "Connection reset by peer".
    # pp=2 x dp_shard=2: the pp group is a sub-group of the world, as in that layout.
    losses = run_world(_last_step_then_leave, world_size=4, args=(end,),
                       parallelism=Parallelism(pp=2, dp_shard=2))  # fmt: skip
    assert len(set(losses)) == 1 and losses[0] > 0
