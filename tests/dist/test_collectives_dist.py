"""Collectives in real processes (gloo, CPU) at world sizes 1, 2 and 4.

One `run_world` per world size runs every collective and returns what each rank saw; the tests
below check those results against values written out by hand, so starting 4-process worlds
(several seconds each on a small machine) happens once per module, not once per test.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from accel import (
    RunContext,
    broadcast,
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from accel.testing import run_world

pytestmark = pytest.mark.dist

Pair = namedtuple("Pair", ["a", "b"])


def _mine(rank: int) -> torch.Tensor:
    return torch.tensor([2.0 * rank + 1, 2.0 * rank + 2])


def _catch(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _collectives(ctx: RunContext) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    x = _mine(r)
    out: dict[str, Any] = {}
    out["gather"] = gather(ctx, x).tolist()
    out["gather_grad"] = gather(ctx, x * torch.ones(2, requires_grad=True)).tolist()
    out["gather_0d"] = gather(ctx, torch.tensor(r)).tolist()
    tree = {
        "x": x,
        "ids": (torch.tensor([[r, 10 * r]], dtype=torch.int64), [torch.tensor([r % 2 == 0])]),
        "pair": Pair(torch.full((1, 3), float(r), dtype=torch.float64), torch.tensor(r)),
    }
    g = gather(ctx, tree)
    out["gather_tree"] = {
        "x": g["x"].tolist(),
        "ids": g["ids"][0].tolist(),
        "ids_dtype": str(g["ids"][0].dtype),
        "flag": g["ids"][1][0].tolist(),
        "pair_type": type(g["pair"]).__name__,
        "pair_a": g["pair"].a.tolist(),
        "pair_a_dtype": str(g["pair"].a.dtype),
        "pair_b": g["pair"].b.tolist(),
    }
    big = torch.arange(5000, dtype=torch.float32) + 10_000 * r  # larger than one header round
    gb = gather(ctx, (big, torch.tensor([r])))
    out["gather_big_ok"] = bool(
        torch.equal(gb[0], torch.cat([torch.arange(5000.0) + 10_000 * k for k in range(n)]))
    ) and gb[1].tolist() == list(range(n))
    bigs = reduce(ctx, big, op="sum"), reduce(ctx, big, op="max"), broadcast(ctx, big, src=n - 1)
    out["big_reduce_broadcast"] = [float(b[-1]) for b in bigs]
    half = gather(ctx, torch.tensor([r + 0.5], dtype=torch.bfloat16))
    out["gather_bf16"] = (str(half.dtype), half.tolist())
    small_int = reduce(ctx, torch.tensor([r], dtype=torch.int32), op="sum")
    out["reduce_int32"] = (str(small_int.dtype), small_int.tolist())
    many = pad_across_processes(ctx, [torch.arange(r + 1)] * 2100)  # sizes too many to inline
    out["pad_many"] = (len(many), many[0].tolist(), many[-1].tolist())
    out["gather_object"] = gather_object(ctx, {"rank": r, "name": f"r{r}"})
    for op in ("sum", "mean", "max", "min"):
        out[f"reduce_{op}"] = reduce(ctx, x, op=op).tolist()
    out["reduce_int_sum"] = reduce(ctx, torch.tensor([r, 1]), op="sum").tolist()
    rt = reduce(ctx, {"a": x, "b": [torch.tensor(float(r))]}, op="max")
    out["reduce_tree"] = {"a": rt["a"].tolist(), "b": rt["b"][0].tolist()}
    out["input_untouched"] = x.tolist()
    out["broadcast_0"] = broadcast(ctx, x).tolist()
    bt = broadcast(ctx, {"v": x, "w": (torch.tensor([r]),)}, src=n - 1)
    out["broadcast_last"] = {"v": bt["v"].tolist(), "w": bt["w"][0].tolist()}
    out["broadcast_object"] = broadcast_object(ctx, {"from": r} if r == n - 1 else None, src=n - 1)
    uneven = torch.arange(1, r + 2)  # rank r holds r + 1 values
    out["pad"] = pad_across_processes(ctx, uneven).tolist()
    out["pad_first"] = pad_across_processes(ctx, uneven, pad_first=True, pad_index=-1).tolist()
    p2 = pad_across_processes(ctx, {"m": torch.ones(2, r + 1)}, dim=1)
    out["pad_dim1"] = p2["m"].tolist()
    out["pad_then_gather"] = gather(ctx, pad_across_processes(ctx, uneven)).tolist()
    if n > 1:  # a mismatch needs two ranks; every rank must raise, and the group must survive
        out["err_shape"] = _catch(gather, ctx, torch.zeros(r + 1))
        dtype = torch.int32 if r else torch.float32
        out["err_dtype"] = _catch(gather, ctx, torch.zeros(2, dtype=dtype))
        out["err_big"] = _catch(gather, ctx, torch.zeros(5000 + r))
        out["err_tree"] = _catch(gather, ctx, {"a": x} if r else {"b": x})
        out["err_reduce"] = _catch(reduce, ctx, torch.zeros(2, r + 1))
        out["err_broadcast"] = _catch(broadcast, ctx, torch.zeros(r + 1))
        out["err_pad"] = _catch(pad_across_processes, ctx, torch.zeros(2, r + 1), dim=0)
        out["after_errors"] = gather(ctx, torch.tensor([r])).tolist()
    return out


@pytest.fixture(scope="module", params=[1, 2, 4])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    n = request.param
    return n, run_world(_collectives, world_size=n, timeout=120)


def _same_everywhere(results: list[dict[str, Any]], key: str) -> Any:
    values = [res[key] for res in results]
    assert all(v == values[0] for v in values), (key, values)
    return values[0]


def test_gather_concatenates_in_rank_order(world: Any) -> None:
    n, results = world
    assert _same_everywhere(results, "gather") == [float(v) for v in range(1, 2 * n + 1)]
    # A 0-dim tensor becomes one value per rank; one process returns its input as it is.
    assert _same_everywhere(results, "gather_grad") == [float(v) for v in range(1, 2 * n + 1)]
    assert _same_everywhere(results, "gather_0d") == (0 if n == 1 else list(range(n)))
    assert _same_everywhere(results, "gather_big_ok") is True


def test_gather_keeps_the_tree_and_dtypes(world: Any) -> None:
    n, results = world
    assert _same_everywhere(results, "gather_tree") == {
        "x": [float(v) for v in range(1, 2 * n + 1)],
        "ids": [[k, 10 * k] for k in range(n)],
        "ids_dtype": "torch.int64",
        "flag": [k % 2 == 0 for k in range(n)],
        "pair_type": "Pair",
        "pair_a": [[float(k)] * 3 for k in range(n)],
        "pair_a_dtype": "torch.float64",
        "pair_b": 0 if n == 1 else list(range(n)),
    }


def test_dtypes_and_the_two_round_paths(world: Any) -> None:
    n, results = world
    last = 4999.0
    assert _same_everywhere(results, "big_reduce_broadcast") == [
        sum(last + 10_000 * k for k in range(n)),
        last + 10_000 * (n - 1),
        last + 10_000 * (n - 1),
    ]
    assert _same_everywhere(results, "gather_bf16") == (
        "torch.bfloat16",
        [k + 0.5 for k in range(n)],
    )
    assert _same_everywhere(results, "reduce_int32") == ("torch.int32", [n * (n - 1) // 2])
    for r, res in enumerate(results):
        padded = list(range(r + 1)) + [0] * (n - r - 1)
        assert res["pad_many"] == (2100, padded, padded)


def test_gather_object(world: Any) -> None:
    n, results = world
    expected = [{"rank": k, "name": f"r{k}"} for k in range(n)]
    assert _same_everywhere(results, "gather_object") == expected


def test_reduce_every_op(world: Any) -> None:
    n, results = world
    firsts = [2.0 * k + 1 for k in range(n)]
    seconds = [2.0 * k + 2 for k in range(n)]
    assert _same_everywhere(results, "reduce_sum") == [sum(firsts), sum(seconds)]
    assert _same_everywhere(results, "reduce_mean") == [sum(firsts) / n, sum(seconds) / n]
    assert _same_everywhere(results, "reduce_max") == [2.0 * n - 1, 2.0 * n]
    assert _same_everywhere(results, "reduce_min") == [1.0, 2.0]
    assert _same_everywhere(results, "reduce_int_sum") == [n * (n - 1) // 2, n]
    assert _same_everywhere(results, "reduce_tree") == {
        "a": [2.0 * n - 1, 2.0 * n],
        "b": float(n - 1),
    }
    assert [res["input_untouched"] for res in results] == [
        [2.0 * k + 1, 2.0 * k + 2] for k in range(n)
    ]


def test_broadcast_and_broadcast_object(world: Any) -> None:
    n, results = world
    assert _same_everywhere(results, "broadcast_0") == [1.0, 2.0]
    assert _same_everywhere(results, "broadcast_last") == {
        "v": [2.0 * n - 1, 2.0 * n],
        "w": [n - 1],
    }
    assert _same_everywhere(results, "broadcast_object") == {"from": n - 1}


def test_pad_across_processes(world: Any) -> None:
    n, results = world
    for r, res in enumerate(results):
        values = list(range(1, r + 2))
        assert res["pad"] == values + [0] * (n - r - 1)
        assert res["pad_first"] == [-1] * (n - r - 1) + values
        assert res["pad_dim1"] == [[1.0] * (r + 1) + [0.0] * (n - r - 1)] * 2
    assert _same_everywhere(results, "pad_then_gather") == [
        v for k in range(n) for v in list(range(1, k + 2)) + [0] * (n - k - 1)
    ]


def test_mismatched_inputs_raise_on_every_rank_naming_ranks_and_shapes(world: Any) -> None:
    n, results = world
    if n == 1:  # one rank cannot disagree with itself: its input comes back unchanged
        assert results[0]["gather"] == [1.0, 2.0]
        return
    for res in results:
        shape = res["err_shape"]
        assert shape.startswith("ValueError: gather: the ranks passed different inputs")
        for k in range(n):
            assert f"rank {k}: * float32[{k + 1}]" in shape
        assert "pad_across_processes" in shape  # the fix
        assert "rank 0: * float32[2]" in res["err_dtype"]
        assert "rank 1: * int32[2]" in res["err_dtype"]
        assert "rank 0: * float32[5000]" in res["err_big"]
        assert "rank 1: * float32[5001]" in res["err_big"]
        assert "rank 0: dict['b'](*)" in res["err_tree"]
        assert "rank 1: dict['a'](*)" in res["err_tree"]
        assert "reduce: the ranks passed different inputs" in res["err_reduce"]
        assert "rank 1: * float32[2, 2]" in res["err_reduce"]
        assert "broadcast: the ranks passed different inputs" in res["err_broadcast"]
        assert "pad_across_processes: the ranks passed different inputs" in res["err_pad"]
        assert "rank 1: * float32[-1, 2]" in res["err_pad"]
        assert res["after_errors"] == list(range(n))


def _disagreeing_calls(ctx: RunContext) -> dict[str, str]:
    big = torch.arange(5001, dtype=torch.float32)  # 20 KiB: past the first round's inline bytes
    small = torch.arange(4, dtype=torch.float32)
    out = {}
    for size, x in (("big", big), ("small", small)):
        out[f"op_{size}"] = _catch(reduce, ctx, x, op="sum" if ctx.rank == 0 else "max")
        out[f"src_{size}"] = _catch(broadcast, ctx, x, src=ctx.rank)
        call = gather if ctx.rank == 0 else reduce
        out[f"which_{size}"] = _catch(call, ctx, x)
        out[f"dim_{size}"] = _catch(pad_across_processes, ctx, x.view(1, -1), dim=ctx.rank)
    out["after"] = str(reduce(ctx, big, op="sum")[:3].tolist())  # the world still works
    return out


def test_ranks_disagreeing_on_op_src_or_collective_all_get_an_error() -> None:
    results = run_world(_disagreeing_calls, world_size=2, timeout=60)
    for res in results:
        for size in ("big", "small"):
            assert "reduce(op='sum')" in res[f"op_{size}"], res[f"op_{size}"]
            assert "reduce(op='max')" in res[f"op_{size}"], res[f"op_{size}"]
            assert "broadcast(src=0)" in res[f"src_{size}"], res[f"src_{size}"]
            assert "broadcast(src=1)" in res[f"src_{size}"], res[f"src_{size}"]
            assert "rank 0: gather" in res[f"which_{size}"], res[f"which_{size}"]
            assert "rank 1: reduce" in res[f"which_{size}"], res[f"which_{size}"]
            assert "pad_across_processes(dim=1)" in res[f"dim_{size}"], res[f"dim_{size}"]
        assert res["after"] == "[0.0, 2.0, 4.0]"
