"""wrap_model at 2 and 4 gloo ranks: what a model starts from, and activation checkpointing under
every strategy.

- docs/checkpoints.md's sharded load (`init_empty_weights`, `wrap_model(strategy="fsdp2")`,
  `load_checkpoint_in_model`) runs as written and gives the checkpoint's values (issue 29, 13).
- Ranks that built their model from different seeds start training from rank 0's weights under
  FSDP2 and tensor parallelism, as DDP's broadcast gives (issue 29, 14).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel import FSDPOptions, Parallelism
from accel.testing import run_world
from tests.models import TP_PLAN, Block, Llama, batches, full_param, lm_loss, make_model

pytestmark = pytest.mark.dist


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_param(q) for n, q in accel.unwrap_model(model).named_parameters()}


def _documented_sharded_load(ctx: accel.RunContext, folder: str, layers: bool) -> Any:
    # The three lines of docs/checkpoints.md, "Loading pretrained weights into a sharded model".
    with accel.init_empty_weights():
        model = Llama()
    fsdp = FSDPOptions(layer_classes=(Block,)) if layers else None
    model = accel.wrap_model(ctx, model, strategy="fsdp2", fsdp=fsdp)
    accel.load_checkpoint_in_model(model, folder)
    return {"state": _full_state(model), "loss": lm_loss(model, batches(1, 2)[0]).item()}


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "layers"), [(2, False), (2, True), (4, True)])
def test_the_documented_sharded_load_gives_the_checkpoints_values(
    tmp_path: Path, world_size: int, layers: bool
) -> None:
    source = make_model(seed=3)
    accel.save_model(accel.RunContext.single(device="cpu"), source, tmp_path)
    results = run_world(
        _documented_sharded_load,
        world_size=world_size,
        args=(str(tmp_path), layers),
        timeout=240,
    )
    with torch.no_grad():
        expected_loss = lm_loss(source, batches(1, 2)[0]).item()
    for out in results:
        for name, value in source.named_parameters():
            assert torch.equal(out["state"][name], value.detach()), name
        assert out["loss"] == pytest.approx(expected_loss, rel=1e-6)


def _per_rank_seed(ctx: accel.RunContext, plan: bool) -> dict[str, Any]:
    # Each rank seeds differently (a per-rank seed rule), then builds and wraps its model.
    model = accel.wrap_model(
        ctx, make_model(seed=100 + ctx.rank), tp_plan=TP_PLAN if plan else None
    )
    start = _full_state(model)
    loss = accel.reduce(accel.along(ctx, "dp"), lm_loss(model, batches(1, 2)[0]), op="mean")
    return {"start": start, "loss": loss.item()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallelism", "plan"),
    [(Parallelism(dp_shard=2), False), (Parallelism(tp=2), True)],
    ids=["fsdp2", "tp"],
)
def test_ranks_seeded_differently_start_from_rank_0s_weights(
    parallelism: Parallelism, plan: bool
) -> None:
    results = run_world(_per_rank_seed, world_size=2, args=(plan,), parallelism=parallelism)
    rank0 = make_model(seed=100)
    with torch.no_grad():
        expected_loss = lm_loss(rank0, batches(1, 2)[0]).item()
    for out in results:
        for name, value in rank0.named_parameters():
            assert torch.equal(out["start"][name], value.detach()), name
        assert out["loss"] == pytest.approx(expected_loss, rel=1e-5)


def _losses_with_and_without_checkpointing(
    ctx: accel.RunContext, plan: bool, checkpointing: Any
) -> dict[str, Any]:
    """Two optimizer steps from the same start, with and without activation checkpointing.

    `checkpointing="FSDPOptions"` asks through the deprecated FSDPOptions field instead.
    """
    out: dict[str, Any] = {}
    sharded = ctx.dp_size > 1 and ctx.parallelism is not None
    for name, value in (("plain", False), ("checkpointed", checkpointing)):
        fsdp = FSDPOptions(layer_classes=(Block,)) if sharded else None
        if value == "FSDPOptions":
            with pytest.warns(DeprecationWarning, match=r"activation_checkpointing=True is dep"):
                fsdp = FSDPOptions(layer_classes=(Block,), activation_checkpointing=True)
            value = None
        model = accel.wrap_model(
            ctx,
            make_model(seed=4),
            tp_plan=TP_PLAN if plan else None,
            fsdp=fsdp,
            activation_checkpointing=value,
        )
        calls = [0]  # attention's forward runs twice per step when it is recomputed
        accel.unwrap_model(model).layers[0].attention.register_forward_pre_hook(
            lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for tokens in batches(2, 2 * ctx.dp_size):
            mine = tokens[ctx.dp_rank * 2 : (ctx.dp_rank + 1) * 2]
            loss = lm_loss(model, mine)
            accel.scaled_backward(ctx, loss)
            accel.optimizer_step(ctx, opt)
            opt.zero_grad()
            losses.append(accel.reduce(accel.along(ctx, "dp"), loss.detach(), op="mean").item())
        out[name] = {"losses": losses, "calls": calls[0]}
    return out


def _check_checkpointing(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["checkpointed"]["losses"] == pytest.approx(out["plain"]["losses"], rel=1e-6)
        assert out["plain"]["calls"] == 2
        assert out["checkpointed"]["calls"] == 4  # recomputed in backward


@pytest.mark.parametrize("checkpointing", [True, (Block,), ("Block",)], ids=["all", "cls", "name"])
def test_activation_checkpointing_at_one_process_matches_the_model_without(
    checkpointing: Any,
) -> None:
    ctx = accel.RunContext.single(device="cpu")
    _check_checkpointing([_losses_with_and_without_checkpointing(ctx, False, checkpointing)])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallelism", "plan", "checkpointing"),
    [
        (None, False, True),
        (Parallelism(tp=2), True, True),
        (Parallelism(dp_shard=2), False, (Block,)),
        (Parallelism(dp_shard=2), False, "FSDPOptions"),
    ],
    ids=["ddp", "tp", "fsdp2", "fsdp2-deprecated-option"],
)
def test_activation_checkpointing_under_every_strategy_matches_the_model_without(
    parallelism: Parallelism | None, plan: bool, checkpointing: Any
) -> None:
    results = run_world(
        _losses_with_and_without_checkpointing,
        world_size=2,
        args=(plan, checkpointing),
        parallelism=parallelism,
        timeout=180,
    )
    _check_checkpointing(results)
    assert results[0]["plain"]["losses"] == pytest.approx(results[1]["plain"]["losses"])
