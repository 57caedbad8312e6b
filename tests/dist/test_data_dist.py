"""shard_loader and gather_for_metrics in real gloo worlds of 2 and 4 processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import accel
from accel.testing import run_world

pytestmark = pytest.mark.dist


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def _evaluate(
    ctx: accel.RunContext, loader: accel.ShardedLoader, stop: int | None = None
) -> list[int]:
    out: list[int] = []
    for k, batch in enumerate(loader):
        if k == stop:
            break
        out += accel.gather_for_metrics(ctx, {"pred": batch * 10}, loader=loader)["pred"].tolist()
    return out


def _world(ctx: accel.RunContext, folder: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    res["full"] = _evaluate(ctx, accel.shard_loader(ctx, DataLoader(list(range(13)), batch_size=2)))
    res["early"] = _evaluate(
        ctx, accel.shard_loader(ctx, DataLoader(list(range(13)), batch_size=2)), stop=2
    )
    uneven = accel.shard_loader(
        ctx, DataLoader(list(range(8 * ctx.world_size - 2)), batch_size=4), even_batches=False
    )
    res["uneven"] = _evaluate(ctx, uneven)
    res["iterable"] = _evaluate(ctx, accel.shard_loader(ctx, DataLoader(Stream(13), batch_size=3)))
    # a (predictions, labels) tree of two dtypes, uneven last batches: one exchange, trimmed
    uneven = accel.shard_loader(
        ctx, DataLoader(list(range(8 * ctx.world_size - 2)), batch_size=4), even_batches=False
    )
    pairs = [
        accel.gather_for_metrics(ctx, (b.float().unsqueeze(1).repeat(1, 3), b), loader=uneven)
        for b in uneven
    ]
    res["tree"] = [(p.tolist(), y.tolist()) for p, y in pairs]
    # ranks disagreeing on a trailing dim get an error on every rank, not a hang
    try:
        accel.gather_for_metrics(
            ctx,
            torch.zeros(2, 3 + ctx.rank),
            loader=accel.shard_loader(ctx, DataLoader(list(range(40)), batch_size=2)),
        )
    except RuntimeError as err:  # no batch yielded by that loader yet
        res["err_unstarted"] = str(err)
    loader = accel.shard_loader(ctx, DataLoader(list(range(40)), batch_size=2))
    live = iter(loader)  # a pass whose iterator is dropped is no longer current (issue 29)
    batch = next(live)
    try:
        accel.gather_for_metrics(ctx, torch.zeros(len(batch), 3 + ctx.rank), loader=loader)
    except ValueError as err:
        res["err_shape"] = str(err)
    res["after_error"] = accel.gather_for_metrics(ctx, batch, loader=loader).tolist()
    # evaluation in the middle of a training epoch does not disturb the training loader
    train = accel.shard_loader(
        ctx, DataLoader(list(range(30)), batch_size=2, shuffle=True), seed=11
    )
    seen, evals = [], []
    for k, batch in enumerate(train):
        seen.append(batch.tolist())
        if k == 1:
            evals = _evaluate(
                ctx, accel.shard_loader(ctx, DataLoader(list(range(7)), batch_size=3))
            )
    res["train"], res["mid_eval"] = seen, evals
    # interrupted run: three batches of epoch 1, then save the position
    train.set_epoch(1)
    it = iter(train)
    res["head"] = [next(it).tolist() for _ in range(3)]
    Path(folder, f"{ctx.rank}.json").write_text(json.dumps(train.state_dict()))
    full = accel.shard_loader(ctx, DataLoader(list(range(30)), batch_size=2, shuffle=True), seed=11)
    full.set_epoch(1)
    res["epoch1"] = [b.tolist() for b in full]
    res.update(_objects_and_empty_ranks(ctx))
    return res


def _objects_and_empty_ranks(ctx: accel.RunContext) -> dict[str, Any]:
    res: dict[str, Any] = {}
    # decoded text: every real sample's string once, the repeats of the last round dropped
    texts = accel.shard_loader(ctx, DataLoader(list(range(13)), batch_size=2))
    res["objects"] = [
        s
        for b in texts
        for s in accel.gather_for_metrics(ctx, [f"s{i}" for i in b.tolist()], loader=texts)
    ]
    # even_batches=False with fewer batches than ranks: a rank past its last batch takes part
    # with nothing in each round it lacks
    for kind in ("objects_sparse", "tensors_sparse"):
        sparse = accel.shard_loader(
            ctx, DataLoader(list(range(3)), batch_size=2), even_batches=False
        )
        rounds = max(accel.gather_object(ctx, len(sparse)))
        it, out = iter(sparse), []
        for _ in range(rounds):
            b = next(it, None)
            if b is None:
                got = accel.gather_for_metrics(ctx, [], loader=sparse)
            else:
                got = accel.gather_for_metrics(
                    ctx,
                    [f"s{i}" for i in b.tolist()] if kind == "objects_sparse" else b * 10,
                    loader=sparse,
                )
            out += got if isinstance(got, list) else got.tolist()
        res[kind] = out
    # the no_trainer scripts' loss.repeat(batch_size) in an uneven round (Accelerate's rule:
    # every rank's rows in rank order, cut to the round's real samples, 3 of them)
    sparse = accel.shard_loader(ctx, DataLoader(list(range(3)), batch_size=2), even_batches=False)
    rounds, it, out = max(accel.gather_object(ctx, len(sparse))), iter(sparse), []
    for _ in range(rounds):
        b = next(it, None)
        loss = None if b is None else b.float().mean().repeat(2)
        got = accel.gather_for_metrics(ctx, [] if loss is None else loss, loader=sparse)
        out += got if isinstance(got, list) else got.tolist()
    res["repeat_sparse"] = out
    return res


def _resume(ctx: accel.RunContext, folder: str) -> list[list[int]]:
    train = accel.shard_loader(
        ctx, DataLoader(list(range(30)), batch_size=2, shuffle=True), seed=11
    )
    train.load_state_dict(json.loads(Path(folder, f"{ctx.rank}.json").read_text()))
    return [b.tolist() for b in train]


@pytest.fixture(scope="module", params=[2, 4])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, str, list[Any]]:
    folder = str(tmp_path_factory.mktemp(f"data{request.param}"))
    return (
        request.param,
        folder,
        run_world(_world, world_size=request.param, timeout=180, args=(folder,)),
    )


def test_every_sample_is_counted_once_in_order(world: tuple[int, str, list[Any]]) -> None:
    _, _, results = world
    for res in results:  # every rank gets the same gathered values
        assert res["full"] == [10 * i for i in range(13)]
        assert res["iterable"] == [10 * i for i in range(13)]
        assert res["mid_eval"] == [10 * i for i in range(7)]


def test_a_tree_of_two_dtypes_comes_back_whole_and_trimmed(
    world: tuple[int, str, list[Any]],
) -> None:
    n, _, results = world
    for res in results:
        preds = [row for p, _ in res["tree"] for row in p]
        labels = [y for _, ys in res["tree"] for y in ys]
        assert labels == list(range(8 * n - 2))
        assert preds == [[float(i)] * 3 for i in range(8 * n - 2)]


def test_ranks_disagreeing_on_shapes_raise_on_every_rank(world: tuple[int, str, list[Any]]) -> None:
    n, _, results = world
    for res in results:
        assert "has not yielded a batch yet" in res["err_unstarted"]
        assert res["err_shape"].startswith("gather_for_metrics: the ranks passed different inputs")
        for k in range(n):
            assert f"rank {k}: * float32[2, {3 + k}]" in res["err_shape"]
        assert res["after_error"] == [2 * k + i for k in range(n) for i in range(2)]


def test_python_objects_come_back_once_each_without_repeats(
    world: tuple[int, str, list[Any]],
) -> None:
    _, _, results = world
    for res in results:
        assert res["objects"] == [f"s{i}" for i in range(13)]


def test_a_rank_without_a_batch_contributes_nothing(world: tuple[int, str, list[Any]]) -> None:
    _, _, results = world
    for res in results:
        assert res["objects_sparse"] == ["s0", "s1", "s2"]
        assert res["tensors_sparse"] == [0, 10, 20]
        assert res["repeat_sparse"] == [0.5, 0.5, 2.0]


def test_early_break_gathers_the_rounds_seen(world: tuple[int, str, list[Any]]) -> None:
    n, _, results = world
    assert all(res["early"] == [10 * i for i in range(min(13, 2 * 2 * n))] for res in results)


def test_uneven_last_batches_are_padded_then_trimmed(world: tuple[int, str, list[Any]]) -> None:
    n, _, results = world
    assert all(res["uneven"] == [10 * i for i in range(8 * n - 2)] for res in results)


def test_training_shards_cover_the_data_with_equal_batch_counts(
    world: tuple[int, str, list[Any]],
) -> None:
    n, _, results = world
    counts = {len(res["train"]) for res in results}
    assert counts == {-(-15 // n)}  # 15 batches of 2, the last round completed
    samples = [i for res in results for b in res["train"] for i in b]
    assert set(samples) == set(range(30))
    assert len(samples) - 30 == (-(-15 // n) * n - 15) * 2  # only the completion repeats


def test_resume_in_new_processes_yields_exactly_the_rest(world: tuple[int, str, list[Any]]) -> None:
    n, folder, results = world
    resumed = run_world(_resume, world_size=n, timeout=120, args=(folder,))
    for res, rest in zip(results, resumed, strict=True):
        assert res["head"] + rest == res["epoch1"]
        assert res["epoch1"] != res["train"]  # a new order in the new epoch


# -- gather_for_metrics with a loader that did not yield the batch (issue 29 item 12) ---------


def _gather_with_the_training_loader(ctx: accel.RunContext) -> str | list[int]:
    train = accel.shard_loader(ctx, DataLoader(list(range(40)), batch_size=4))
    for k, _ in enumerate(train):
        if k == 1:
            break  # the training pass is left in its middle
    evaluation = accel.shard_loader(ctx, DataLoader(list(range(37)), batch_size=4))
    gathered: list[int] = []
    try:
        for batch in evaluation:
            gathered += accel.gather_for_metrics(ctx, batch, loader=train).tolist()
    except RuntimeError as err:  # raised on every rank, before any collective
        return str(err)
    return gathered  # what a silently wrong gather returned


def test_gathering_with_another_loaders_left_pass_raises_on_every_rank() -> None:
    for got in run_world(_gather_with_the_training_loader, world_size=2, timeout=120):
        assert isinstance(got, str), f"gathered {len(got)} samples, {len(set(got))} unique"
        assert got.startswith("gather_for_metrics: loader=")
        assert "left its pass" in got
