"""`Parallelism`, the mesh coordinates of `RunContext` and `along`, with no process group."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import accel
from accel import Parallelism, RunContext, along


def test_coordinates_are_row_major_over_replicate_shard_cp_tp() -> None:
    p = Parallelism(dp_replicate=2, dp_shard=3, tp=2)
    ranks = itertools.product(range(2), range(3), range(1), range(2))
    for rank, (rep, shard, cp, tp) in enumerate(ranks):
        ctx = RunContext(rank=rank, world_size=12, parallelism=p)
        assert (ctx.tp_rank, ctx.cp_rank, ctx.dp_rank) == (tp, cp, rep * 3 + shard)
        assert (ctx.tp_size, ctx.cp_size, ctx.dp_size) == (2, 1, 6)
        assert along(ctx, "dp_shard").rank == shard
        assert along(ctx, "dp_replicate").rank == rep
        assert along(ctx, "dp").world_size == 6


def test_a_hand_built_context_answers_without_a_process_group() -> None:
    ctx = RunContext(rank=3, world_size=4, parallelism=Parallelism(dp_shard=2, tp=2))
    assert (ctx.dp_rank, ctx.dp_size, ctx.tp_rank, ctx.tp_size) == (1, 2, 1, 2)
    tp = along(ctx, "tp")
    assert (tp.rank, tp.world_size, tp.process_group, tp.parallelism) == (1, 2, None, None)


def test_the_default_is_pure_data_parallelism() -> None:
    ctx = RunContext(rank=2, world_size=4)
    assert (ctx.dp_rank, ctx.dp_size, ctx.tp_size, ctx.cp_size) == (2, 4, 1, 1)
    assert along(ctx, "dp") == dataclasses.replace(ctx, sources=ctx.sources)


def test_one_minus_one_fills_the_world() -> None:
    ctx = RunContext(rank=0, world_size=8, parallelism=Parallelism(dp_shard=-1, tp=2))
    assert ctx.parallelism == Parallelism(dp_shard=4, tp=2)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"dp_shard": 0}, "dp_shard=0 must be an int >= 1, or -1"),
        ({"tp": 2.0}, "tp=2.0 must be an int"),
        ({"dp_shard": -1, "tp": -1}, "at most one size may be -1"),
    ],
)
def test_bad_sizes_are_refused_by_name(sizes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Parallelism(**sizes)  # type: ignore[arg-type]


def test_sizes_that_do_not_multiply_to_the_world_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"dp_shard=2 x cp=1 x tp=3 does not multiply to world_size=4"
    ):
        RunContext(world_size=4, parallelism=Parallelism(dp_shard=2, tp=3))
    with pytest.raises(ValueError, match="does not multiply to world_size=4"):
        RunContext(world_size=4, parallelism=Parallelism(dp_shard=-1, tp=3))


def test_along_refuses_an_unknown_dimension() -> None:
    with pytest.raises(ValueError, match=r"dim='expert' is not a mesh dimension"):
        along(RunContext(), "expert")  # type: ignore[arg-type]


def test_sp_and_ep_coordinates_are_row_major_in_mesh_order() -> None:
    # mesh order pp, dp_replicate, dp_shard, ep, cp, sp, tp: sp inside, tp innermost
    p = Parallelism(dp_shard=2, ep=2, sp=2, tp=2)
    for rank in range(16):
        ctx = RunContext(rank=rank, world_size=16, parallelism=p)
        tp, sp, ep, shard = rank % 2, rank // 2 % 2, rank // 4 % 2, rank // 8
        assert (ctx.tp_rank, ctx.sp_rank, ctx.ep_rank) == (tp, sp, ep)
        assert (ctx.dp_rank, ctx.dp_size) == (shard * 2 + ep, 4)  # ep ranks see their own data
        assert (ctx.sp_size, ctx.ep_size) == (2, 2)
        assert along(ctx, "sp").rank == sp and along(ctx, "ep").world_size == 2
    assert repr(Parallelism(tp=2)) == "Parallelism(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2)"
    assert repr(Parallelism(sp=2)).endswith("tp=1, sp=2)")


def test_describe_shows_the_parallelism_and_its_source() -> None:
    ctx = RunContext(
        world_size=4, parallelism=Parallelism(dp_shard=2, tp=2), sources={"parallelism": "argument"}
    )
    line = next(s for s in ctx.describe().splitlines() if s.startswith("parallelism"))
    assert "dp_shard=2" in line and "tp=2" in line and line.endswith("(argument)")


def test_init_distributed_takes_parallelism_from_the_argument_and_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ctx = accel.init_distributed(device="cpu", parallelism=Parallelism(tp=-1))
    assert ctx.parallelism == Parallelism() and ctx.sources["parallelism"] == "argument"
    monkeypatch.setenv("ACCEL_TP_SIZE", "1")
    monkeypatch.setenv("ACCEL_DP_SHARD_SIZE", "-1")
    ctx = accel.init_distributed(device="cpu")
    assert ctx.parallelism == Parallelism()
    assert ctx.sources["parallelism"] == "env ACCEL_DP_SHARD_SIZE, ACCEL_TP_SIZE"
    monkeypatch.setenv("ACCEL_TP_SIZE", "two")
    with pytest.raises(ValueError, match="ACCEL_TP_SIZE='two' must be an integer"):
        accel.init_distributed(device="cpu")


def test_context_parallelism_is_refused_off_cuda() -> None:
    from accel._mesh import check_cp

    with pytest.raises(NotImplementedError, match=r"cp=2 needs CUDA"):
        check_cp("init_distributed", Parallelism(cp=2), torch.device("cpu").type)


def test_tensor_parallel_peers_get_the_same_batches() -> None:
    from torch.utils.data import DataLoader

    p = Parallelism(dp_shard=2, tp=2)
    seen = [
        [
            b.tolist()
            for b in accel.shard_loader(
                RunContext(rank=r, world_size=4, parallelism=p),
                DataLoader(list(range(8)), batch_size=2),
            )
        ]
        for r in range(4)
    ]
    assert seen[0] == seen[1] == [[0, 1], [4, 5]]
    assert seen[2] == seen[3] == [[2, 3], [6, 7]]
