"""Local SGD at 2 gloo ranks against a hand computation.

Each rank trains on its own data with plain SGD and no gradient all-reduce; every K optimizer
steps (and on leaving `local_sgd`) the parameters are averaged. The test recomputes this in the
parent, one independent model per rank, averaging by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_world

pytestmark = pytest.mark.dist

WORLD, STEPS, EVERY, LR = 2, 7, 3, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    return (model(x) - y).pow(2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(ctx: accel.RunContext) -> dict[str, Any]:
    model = accel.wrap_model(ctx, _model(), strategy="ddp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params, averaged = [], []
    with accel.local_sgd(ctx, model):
        for step in range(STEPS):
            _loss(model, ctx.rank, step).backward()
            opt.step()
            opt.zero_grad()
            averaged.append(accel.local_sgd_step(ctx, model, step=step, every=EVERY))
            params.append(_flat(model))
    from torch.distributed.fsdp import fully_shard

    try:
        accel.average_parameters(ctx, fully_shard(nn.Linear(2, 2)))
        refused = ""
    except NotImplementedError as err:
        refused = str(err)
    return {"params": params, "final": _flat(model), "averaged": averaged, "refused": refused}


def _reference() -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    models = [_model() for _ in range(WORLD)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    history: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]

    def average() -> None:
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in models), strict=True):
                mean = sum(p.clone() for p in ps) / WORLD
                for p in ps:
                    p.copy_(mean)

    for step in range(STEPS):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            _loss(m, rank, step).backward()
            o.step()
            o.zero_grad()
        if (step + 1) % EVERY == 0:
            average()
        for rank, m in enumerate(models):
            history[rank].append(_flat(m))
    average()
    return history, _flat(models[0])


@pytest.mark.slow
def test_local_sgd_equals_independent_sgd_averaged_every_k_steps() -> None:
    results = run_world(_train, world_size=WORLD, timeout=120)
    history, final = _reference()
    for rank, res in enumerate(results):
        assert res["averaged"] == [(s + 1) % EVERY == 0 for s in range(STEPS)]
        for got, want in zip(res["params"], history[rank], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["final"], final, rtol=1e-6, atol=1e-6)
        assert "sharded by FSDP2" in res["refused"]
    # Inside a window the ranks really differ (no all-reduce); after an average they agree.
    assert not torch.allclose(results[0]["params"][0], results[1]["params"][0])
    assert torch.equal(results[0]["params"][EVERY - 1], results[1]["params"][EVERY - 1])
