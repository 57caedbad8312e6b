"""shard_loader and ShardPlan without processes: layouts, coverage, resume, errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset

import accel
from accel import RunContext, ShardPlan


def reference_layout(
    batches: list[list[int]], rank: int, n: int, size: int, split: bool, even: bool, drop_last: bool
) -> list[list[int]]:
    """Accelerate's BatchSamplerShard iteration, re-expressed step by step as its generator runs."""
    out: list[list[int]] = []
    if split:
        per = size // n
        initial: list[int] = []
        batch: list[int] = []
        for idx, batch in enumerate(batches):
            if idx == 0:
                initial = list(batch)
            if len(batch) == size:
                out.append(batch[per * rank : per * (rank + 1)])
        if not drop_last and initial and len(batch) < size:
            if not even:
                if len(batch) > per * rank:
                    out.append(batch[per * rank : per * (rank + 1)])
            else:
                while len(initial) < size:
                    initial += initial
                full = batch + initial
                out.append(full[per * rank : per * (rank + 1)])
        return out
    initial, to_yield, batch, idx = [], [], [], -1
    for idx, batch in enumerate(batches):
        if not drop_last and idx < n:
            initial += batch
        if idx % n == rank:
            to_yield = batch
        if idx % n == n - 1 and len(batch) == size:
            out.append(to_yield)
            to_yield = []
    if not drop_last and initial:
        if not even:
            if to_yield:
                out.append(to_yield)
        else:
            if len(to_yield) == size:
                out.append(to_yield)
            while len(initial) < n * size:
                initial += initial
            batch = list(batch)
            if len(batch) == size:
                batch, idx = [], idx + 1
            cycle = 0
            while idx % n != 0 or batch:
                end = cycle + size - len(batch)
                batch = batch + initial[cycle:end]
                if idx % n == rank:
                    out.append(batch)
                cycle, batch, idx = end, [], idx + 1
    return out


def _batches(length: int, size: int, drop_last: bool) -> list[list[int]]:
    batches = [list(range(i, min(i + size, length))) for i in range(0, length, size)]
    return batches[:-1] if drop_last and batches and len(batches[-1]) < size else batches


CONFIGS = list(itertools.product((False, True), repeat=3))


@pytest.mark.parametrize(("split", "even", "drop_last"), CONFIGS)
def test_every_layout_matches_accelerate_and_counts_each_sample_once(
    split: bool, even: bool, drop_last: bool
) -> None:
    for n, length, size in itertools.product(range(1, 5), range(41), range(1, 6)):
        if split and size % n:
            with pytest.raises(ValueError, match="not divisible by the world size"):
                ShardPlan(rank=0, world_size=n, batch_size=size, split_batches=True)
            continue
        batches = _batches(length, size, drop_last)
        plans = [
            ShardPlan(rank=r, world_size=n, batch_size=size, split_batches=split, even_batches=even,
                      drop_last=drop_last).shard(batches)
            for r in range(n)
        ]  # fmt: skip
        case = f"n={n} length={length} size={size}"
        for r in range(n):
            expected = reference_layout(batches, r, n, size, split, even, drop_last)
            assert [list(b.indices) for b in plans[r]] == expected, case
        if even or drop_last:
            assert len({len(p) for p in plans}) == 1, case
        # gathering batch i from every rank and dropping padding gives each sample once, in order
        gathered = [
            i
            for k in range(max(len(p) for p in plans))
            for p in plans
            if k < len(p)
            for i in p[k].indices[: p[k].num_real]
        ]
        kept = [i for b in batches for i in b]
        if drop_last:  # the incomplete last round is dropped
            assert gathered == kept[: len(gathered)], case
            assert len(kept) - len(gathered) < n * size, case
        else:
            assert gathered == list(range(length)), case
            covered = {i for p in plans for b in p for i in b.indices}
            assert covered == set(range(length)), case


def _collect(ctx: RunContext, loader: accel.ShardedLoader) -> tuple[list[list[int]], list[Any]]:
    batches, layouts = [], []
    for batch in loader:
        batches.append(batch.tolist())
        layouts.append(loader._layout)
    return batches, layouts


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    length=st.integers(0, 40),
    size=st.integers(1, 5),
    even=st.booleans(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_sharded_loader_follows_the_plan(
    n: int, length: int, size: int, even: bool, drop_last: bool, shuffle: bool
) -> None:
    seen: list[list[list[int]]] = []
    for r in range(n):
        ctx = RunContext(rank=r, world_size=n, seed=7)
        torch.manual_seed(r)  # a different global RNG per rank must not change the order
        base = DataLoader(  # torch refuses to shuffle an empty dataset
            list(range(length)),
            batch_size=size,
            shuffle=shuffle and length > 0,
            drop_last=drop_last,
        )
        loader = accel.shard_loader(ctx, base, even_batches=even)
        batches, layouts = _collect(ctx, loader)
        assert len(batches) == len(loader) or length == 0
        assert all(lay[r][0] == len(b) for lay, b in zip(layouts, batches, strict=True))
        seen.append(batches)
    flat = sorted({i for rank in seen for b in rank for i in b})
    if not drop_last:
        assert flat == list(range(length))
    if even:
        assert len({len(s) for s in seen}) == 1


def test_shuffling_is_the_same_on_every_rank_and_new_each_epoch() -> None:
    orders = []
    for r in range(2):
        loader = accel.shard_loader(
            RunContext(rank=r, world_size=2, seed=3),
            DataLoader(list(range(20)), batch_size=2, shuffle=True),
        )
        torch.manual_seed(100 + r)
        epochs = [[x for b in loader for x in b.tolist()] for _ in range(2)]
        orders.append(epochs)
    # rank 0 and rank 1 interleave batches of one permutation per epoch
    for epoch in range(2):
        both = orders[0][epoch] + orders[1][epoch]
        assert sorted(both) == list(range(20))
    assert orders[0][0] != orders[0][1], "epoch 1 must differ from epoch 0"


class Counting(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        return i


def test_resume_mid_epoch_yields_the_rest_without_loading_skipped_samples() -> None:
    ctx = RunContext(rank=1, world_size=2, seed=5)

    def make(ds: Dataset[int]) -> accel.ShardedLoader:
        return accel.shard_loader(ctx, DataLoader(ds, batch_size=3, shuffle=True))

    full = make(Counting(50))
    full.set_epoch(1)
    expected = [b.tolist() for b in full]
    first = make(Counting(50))
    first.set_epoch(1)
    it = iter(first)
    head = [next(it).tolist() for _ in range(4)]
    state = first.state_dict()
    assert state == {"epoch": 1, "position": 4, "world_size": 2, "dataset_length": 50, "seed": 5}
    ds = Counting(50)
    resumed = make(ds)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert head + rest == expected
    assert ds.calls == sum(len(b) for b in rest)  # the 4 skipped batches were never read
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["position"] == 0


class WorkerSeed(Dataset[int]):
    """Each sample is the torch seed of the process that loaded it (a worker's, with workers)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


def test_iterating_leaves_the_global_rng_alone_and_workers_reseed_alike_after_resume() -> None:
    # A DataLoader draws its workers' base seed from torch's global RNG when it starts an
    # iterator; a resumed run starts one where the uninterrupted run did not, which shifted
    # every later dropout mask (char_lm drifted from the first step after resuming).
    ctx = RunContext(rank=0, world_size=2, seed=3)
    loader = accel.shard_loader(ctx, DataLoader(Counting(20), batch_size=2, shuffle=True))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for _ in range(2):
        list(loader)
    assert torch.equal(torch.get_rng_state(), before)

    def seeds(position: int) -> list[int]:
        ld = accel.shard_loader(ctx, DataLoader(WorkerSeed(), batch_size=1, num_workers=1))
        ld.load_state_dict(ld.state_dict() | {"epoch": 1, "position": position})
        return [int(b) for b in ld]

    assert seeds(0)[2:] == seeds(2)  # a resumed worker is seeded as the uninterrupted one was


def test_state_from_another_world_or_dataset_is_refused() -> None:
    loader = accel.shard_loader(
        RunContext(rank=0, world_size=2), DataLoader(list(range(10)), batch_size=2)
    )
    state = loader.state_dict()
    other = accel.shard_loader(
        RunContext(rank=0, world_size=4), DataLoader(list(range(10)), batch_size=2)
    )
    with pytest.raises(
        ValueError, match="saved with world_size=2 but this loader has world_size=4"
    ):
        other.load_state_dict(state)
    shorter = accel.shard_loader(
        RunContext(rank=0, world_size=2), DataLoader(list(range(9)), batch_size=2)
    )
    with pytest.raises(ValueError, match="dataset_length=10 but this loader has dataset_length=9"):
        shorter.load_state_dict(state)


def test_bad_configurations_raise_with_the_fix() -> None:
    ctx = RunContext(rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch size 3 is not divisible by the world size 2"):
        accel.shard_loader(ctx, DataLoader(list(range(6)), batch_size=3), split_batches=True)
    with pytest.raises(ValueError, match="split_batches=True needs a loader with a batch size"):
        accel.shard_loader(ctx, DataLoader(list(range(6)), batch_size=None), split_batches=True)
    with pytest.raises(TypeError, match="loader=list is not a torch DataLoader"):
        accel.shard_loader(ctx, [1, 2])  # type: ignore[arg-type]


def test_no_batch_size_shards_single_samples() -> None:
    ctx = RunContext(rank=1, world_size=2)
    loader = accel.shard_loader(ctx, DataLoader(list(range(5)), batch_size=None))
    assert [int(x) for x in loader] == [1, 3, 0]
    assert loader.padding == 1


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_matches_iterable_dataset_shard(drop_last: bool) -> None:
    # chunks of 2 ranks x 3: [0..5] [6..11] [12 + cycled 0..4]
    got = []
    for r in range(2):
        loader = accel.shard_loader(
            RunContext(rank=r, world_size=2),
            DataLoader(Stream(13), batch_size=3, drop_last=drop_last),
        )
        got.append([(b.tolist(), loader.padding) for b in loader])
        assert len(loader) == len(got[-1])
    if drop_last:
        assert got == [[([0, 1, 2], 0), ([6, 7, 8], 0)], [([3, 4, 5], 0), ([9, 10, 11], 0)]]
    else:
        assert got == [
            [([0, 1, 2], 0), ([6, 7, 8], 0), ([12, 0, 1], 2)],
            [([3, 4, 5], 0), ([9, 10, 11], 0), ([2, 3, 4], 3)],
        ]


def test_gather_for_metrics_single_process_and_errors() -> None:
    ctx = RunContext.single()
    loader = accel.shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    with pytest.raises(RuntimeError, match="has not yielded a batch yet"):
        accel.gather_for_metrics(ctx, torch.zeros(2), loader=loader)
    outs = [accel.gather_for_metrics(ctx, {"x": b, "y": b * 2}, loader=loader) for b in loader]
    assert [o["y"].tolist() for o in outs] == [[0, 2], [4, 6], [8]]
    with pytest.raises(ValueError, match=r"use accel\.reduce"):
        accel.gather_for_metrics(ctx, torch.tensor(0.5), loader=loader)
    with pytest.raises(TypeError, match="is not a ShardedLoader"):
        accel.gather_for_metrics(ctx, torch.zeros(1), loader=DataLoader([1]))  # type: ignore[arg-type]


def test_batches_are_moved_to_the_context_device_unless_asked_not_to() -> None:
    ctx = RunContext.single(device=torch.device("meta"))
    loader = accel.shard_loader(ctx, DataLoader(list(range(4)), batch_size=2))
    assert next(iter(loader)).device.type == "meta"
    kept = accel.shard_loader(ctx, DataLoader(list(range(4)), batch_size=2), device_placement=False)
    assert next(iter(kept)).device.type == "cpu"


def test_workers_and_variable_size_batch_samplers() -> None:
    ctx = RunContext(rank=0, world_size=2)
    batch_sampler = [[0], [1, 2], [3, 4, 5], [6], [7, 8]]
    loader = accel.shard_loader(
        ctx, DataLoader(list(range(9)), batch_sampler=batch_sampler, num_workers=2)
    )
    assert [b.tolist() for b in loader] == [[0], [3, 4, 5], [7, 8]]
    other = accel.shard_loader(
        RunContext(rank=1, world_size=2), DataLoader(list(range(9)), batch_sampler=batch_sampler)
    )
    assert [(b.tolist(), other.padding) for b in other] == [([1, 2], 0), ([6], 0), ([0], 1)]
