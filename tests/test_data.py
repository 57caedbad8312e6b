"""shard_loader and ShardPlan without processes: layouts, coverage, resume, errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

import accel
from accel import RunContext, ShardPlan


def reference_layout(
    batches: list[list[int]],
    rank: int,
    n: int,
    size: int | None,
    split: bool,
    even: bool,
    drop_last: bool,
) -> list[list[int]]:
    """Accelerate's BatchSamplerShard iteration, re-expressed step by step as its generator runs.

    At one process Accelerate's prepare_data_loader does not shard: the batches are unchanged.
    `size` is the batch sampler's `batch_size` attribute (None for variable-size batches).
    """
    if n == 1:
        return [list(b) for b in batches]
    out: list[list[int]] = []
    if split:
        assert size is not None
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
        if idx % n == n - 1 and (size is None or len(batch) == size):
            out.append(to_yield)
            to_yield = []
    if not drop_last and initial:
        if not even:
            if to_yield:
                out.append(to_yield)
        else:
            assert size is not None  # Accelerate refuses even_batches without a batch size
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
        layouts.append(loader.layout)
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
    assert state == {"epoch": 1, "position": 4, "world_size": 2, "dataset_length": 50, "seed": 5,
                     "samples": 4 * 2 * 3, "batch_size": 3, "grad_accum_steps": 1}  # fmt: skip
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
    with pytest.raises(ValueError, match=r"global batch changed: saved with per-rank batch 2 x "
                       r"world size 2 x grad_accum_steps 1, resumed with 2 x 4 x 1"):  # fmt: skip
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
    with pytest.raises(ValueError, match="loop over the loader has ended"):
        accel.gather_for_metrics(ctx, torch.tensor([0.5]), loader=loader)
    assert accel.gather_for_metrics(ctx, [], loader=loader) == []
    live = iter(loader)  # a pass whose iterator is dropped is no longer current (issue 29)
    next(live)
    with pytest.raises(ValueError, match=r"shape \(\) has no dim 0.*loss\.repeat\(batch_size\)"):
        accel.gather_for_metrics(ctx, torch.tensor(0.5), loader=loader)
    with pytest.raises(TypeError, match="is not a ShardedLoader"):
        accel.gather_for_metrics(ctx, torch.zeros(1), loader=DataLoader([1]))  # type: ignore[arg-type]


def test_gather_for_metrics_of_rows_not_per_sample_follows_accelerates_rule() -> None:
    # Accelerate's rule: rows that are not one per sample (the no_trainer scripts'
    # loss.repeat(per_device_eval_batch_size)) are kept whole, except in the last, short round,
    # cut to its real samples (len(dataset) % total batch size).
    ctx = RunContext.single()
    loader = accel.shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    rows = [
        accel.gather_for_metrics(ctx, b.float().mean().repeat(2), loader=loader).tolist()
        for b in loader
    ]
    assert rows == [[0.5, 0.5], [2.5, 2.5], [4.0]]
    wide = [accel.gather_for_metrics(ctx, torch.arange(3), loader=loader).tolist() for _ in loader]
    assert wide == [[0, 1, 2], [0, 1, 2], [0]]
    full = accel.shard_loader(ctx, DataLoader(list(range(4)), batch_size=2))  # no short round
    assert [len(accel.gather_for_metrics(ctx, torch.zeros(3), loader=full)) for _ in full] == [3, 3]


def test_gather_for_metrics_of_python_objects_keeps_each_sample_once() -> None:
    ctx = RunContext.single()
    loader = accel.shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    texts = [
        accel.gather_for_metrics(ctx, [f"t{i}" for i in b.tolist()], loader=loader) for b in loader
    ]
    assert texts == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="has 3 items but the batch has 2 samples"):
        accel.gather_for_metrics(ctx, ["a", "b", "c"], loader=loader)
    with pytest.raises(TypeError, match=r"one Python object per sample, e\.g\. list\(zip"):
        accel.gather_for_metrics(ctx, (["a", "b"], ["c", "d"]), loader=loader)
    pairs = accel.gather_for_metrics(ctx, [("a", "x"), ("b", "y")], loader=loader)
    assert pairs == [("a", "x"), ("b", "y")]


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


# -- behaving like a DataLoader (issue 13) ----------------------------------------------------


def test_every_iter_starts_a_full_pass_of_the_current_epoch() -> None:
    # Accelerate's variable-size accumulation recipe: iter() every epoch, next() len() times.
    loader = accel.shard_loader(RunContext.single(), DataLoader(list(range(4)), batch_size=2))
    for _ in range(3):
        it = iter(loader)
        assert [next(it).tolist() for _ in range(len(loader))] == [[0, 1], [2, 3]]
    # an evaluation loop that broke early does not make the next one skip samples
    for _ in loader:
        break
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_iter_per_epoch_shuffles_like_for_loops_and_resumes_only_once() -> None:
    def make() -> accel.ShardedLoader:
        ctx = RunContext(rank=1, world_size=2, seed=4)
        return accel.shard_loader(ctx, DataLoader(list(range(12)), batch_size=2, shuffle=True))

    by_for = make()
    epochs = [[b.tolist() for b in by_for] for _ in range(3)]
    assert epochs[0] != epochs[1]
    by_next = make()
    for epoch in epochs:  # a pass that took every batch with next() ends the epoch
        it = iter(by_next)
        assert [next(it).tolist() for _ in range(len(by_next))] == epoch
    half = make()
    it = iter(half)
    next(it)
    resumed = make()
    resumed.load_state_dict(half.state_dict())
    assert [b.tolist() for b in resumed] == epochs[0][1:]  # the first iter() resumes
    assert [b.tolist() for b in resumed] == epochs[1]  # later ones start a full pass
    again = make()
    again.load_state_dict(half.state_dict())
    again.set_epoch(0)  # the usual `set_epoch(epoch)` at the top of the loop keeps the resume
    assert [b.tolist() for b in again] == epochs[0][1:]


@pytest.mark.parametrize(("shuffle", "drop_last", "split", "even"), list(itertools.product(
    (False, True), repeat=4)))  # fmt: skip
def test_one_process_yields_what_the_dataloader_yields(
    shuffle: bool, drop_last: bool, split: bool, even: bool
) -> None:
    # At world size 1 Accelerate does not shard: nothing is padded or repeated.
    for length, size in itertools.product((1, 5, 6, 7), (2, 3)):
        ctx = RunContext.single(seed=2)
        base = DataLoader(list(range(length)), batch_size=size, drop_last=drop_last)
        loader = accel.shard_loader(
            ctx,
            DataLoader(list(range(length)), batch_size=size, drop_last=drop_last, shuffle=shuffle),
            split_batches=split,
            even_batches=even,
        )
        got = [b.tolist() for b in loader]
        if shuffle:
            order = list(RandomSampler(range(length), generator=torch.Generator().manual_seed(2)))
            batches = [order[i : i + size] for i in range(0, length, size)]
            expected = batches[:-1] if drop_last and len(batches[-1]) < size else batches
        else:
            expected = [b.tolist() for b in base]
        assert got == expected, (length, size)
        assert len(loader) == len(expected)
        assert all(loader.padding == 0 for _ in loader)
    stream = accel.shard_loader(RunContext.single(), DataLoader(Stream(5), batch_size=2))
    assert [b.tolist() for b in stream] == [[0, 1], [2, 3], [4]]
    single = accel.shard_loader(RunContext.single(), DataLoader(list(range(5)), batch_size=2))
    assert [b.tolist() for b in single] == [[0, 1], [2, 3], [4]]


class VariableBatches:
    """A batch sampler of fixed, variable-size batches, with a `drop_last` attribute."""

    def __init__(self, batches: list[list[int]], drop_last: bool) -> None:
        self.batches, self.drop_last = batches, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_variable_batch_sampler_with_drop_last_drops_the_incomplete_round() -> None:
    batches = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    for even in (True, False):
        got = [
            [b.tolist() for b in accel.shard_loader(
                RunContext(rank=r, world_size=2),
                DataLoader(list(range(14)), batch_sampler=VariableBatches(batches, True)),
                even_batches=even,
            )]
            for r in range(2)
        ]  # fmt: skip
        assert got == [[[0, 1, 2], [5, 6, 7, 8]], [[3, 4], [9, 10, 11]]], even


def lent_layout(batches: list[list[int]], rank: int, n: int) -> list[tuple[list[int], int]]:
    """accel's rule for variable-size batches with even_batches (Accelerate refuses them):
    round-robin, and the last round completed with whole batches from the start of the epoch."""
    tail = len(batches) % n
    own = [(b, 0) for k, b in enumerate(batches) if k % n == rank]
    if tail and rank >= tail:
        lent = batches[(rank - tail) % len(batches)]
        own.append((lent, len(lent)))
    return own


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), max_size=12),
    n=st.integers(1, 4),
    split=st.booleans(),
    even=st.booleans(),
    drop_last=st.booleans(),
)
def test_variable_size_batch_samplers_follow_accelerates_rules(
    sizes: list[int], n: int, split: bool, even: bool, drop_last: bool
) -> None:
    starts = list(itertools.accumulate([0, *sizes]))
    batches = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    plans = []
    for r in range(n):
        ctx = RunContext(rank=r, world_size=n)
        sampler = VariableBatches(batches, drop_last)
        base = DataLoader(list(range(starts[-1])), batch_sampler=sampler)
        if split:  # a variable size cannot be cut into world_size equal slices
            with pytest.raises(ValueError, match="split_batches=True needs a loader with a batch"):
                accel.shard_loader(ctx, base, split_batches=True, even_batches=even)
            return
        loader = accel.shard_loader(ctx, base, even_batches=even)
        got = [(b.tolist(), loader.padding) for b in loader]
        assert len(got) == len(loader)
        if n == 1:  # one process: the batches as they are
            assert got == [(b, 0) for b in batches]
        elif drop_last or not even:  # BatchSamplerShard with batch_size=None
            expected = reference_layout(batches, r, n, None, False, even, drop_last)
            assert [b for b, _ in got] == expected
            assert all(p == 0 for _, p in got)
        else:
            assert got == lent_layout(batches, r, n)
        plans.append(got)
    if even or drop_last:  # every rank takes the same number of steps: DDP cannot hang
        assert len({len(p) for p in plans}) == 1
    real = sorted(i for p in plans for b, pad in p for i in b[: len(b) - pad])
    complete = len(batches) - (len(batches) % n if drop_last and n > 1 else 0)
    assert real == [i for b in batches[:complete] for i in b]


@pytest.mark.parametrize("seed", [0, 3, 2024])
def test_seed_gives_accelerates_seedable_sampler_order_every_epoch(seed: int) -> None:
    # Accelerate's SeedableRandomSampler seeds a torch.Generator with data_seed + epoch.
    for via_ctx in (False, True):
        ctx = RunContext.single(seed=seed if via_ctx else None)
        loader = accel.shard_loader(
            ctx,
            DataLoader(list(range(10)), batch_size=3, shuffle=True),
            seed=None if via_ctx else seed,
        )
        for epoch in range(3):
            expected = list(
                RandomSampler(range(10), generator=torch.Generator().manual_seed(seed + epoch))
            )
            assert [i for b in loader for i in b.tolist()] == expected, (seed, epoch)


# -- what a prepared DataLoader exposes (issue 29 item 11) -------------------------------------

LOADER_ATTRIBUTES = (
    "dataset",
    "batch_size",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "drop_last",
    "pin_memory",
    "pin_memory_device",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
)


def _collate_sum(samples: list[int]) -> torch.Tensor:
    return torch.tensor([sum(samples)])


def _init_worker(worker_id: int) -> None:
    del worker_id


@pytest.mark.parametrize("kind", ["map", "batch_sampler", "stream"])
def test_the_dataloader_attributes_scripts_read_are_the_users_and_read_only(kind: str) -> None:
    if kind == "map":
        base = DataLoader(
            list(range(10)),
            batch_size=3,
            shuffle=True,
            drop_last=True,
            collate_fn=_collate_sum,
            worker_init_fn=_init_worker,
            generator=torch.Generator().manual_seed(1),
        )
    elif kind == "batch_sampler":
        base = DataLoader(list(range(10)), batch_sampler=[[0, 1], [2, 3, 4], [5]])
    else:
        base = DataLoader(Stream(7), batch_size=2)
    loader = accel.shard_loader(RunContext(rank=1, world_size=2), base)
    for name in LOADER_ATTRIBUTES:
        assert getattr(loader, name) is getattr(base, name), name
        with pytest.raises(AttributeError, match=rf"ShardedLoader\.{name} is read-only"):
            setattr(loader, name, None)
    # Accelerate's examples/by_feature/multi_process_metrics.py reads the dataset's length
    if kind != "stream":
        assert len(loader.dataset) == len(base.dataset)  # type: ignore[arg-type]


# -- gather_for_metrics with a loader that did not yield the batch (issue 29 item 12) ---------


def test_gathering_with_a_loader_whose_pass_was_left_raises_naming_the_fix() -> None:
    ctx = RunContext.single()
    train = accel.shard_loader(ctx, DataLoader(list(range(40)), batch_size=4))
    for k, _ in enumerate(train):
        if k == 1:
            break  # the training pass is left in its middle
    evaluation = accel.shard_loader(ctx, DataLoader(list(range(37)), batch_size=4))
    for batch in evaluation:  # every batch, the first (whose size matches train's) included
        with pytest.raises(RuntimeError, match=r"^gather_for_metrics: loader=.* left its pass"):
            accel.gather_for_metrics(ctx, batch, loader=train)
    # the loader that yielded the batch still gathers it, and a new pass of train is current
    gathered = [accel.gather_for_metrics(ctx, b, loader=evaluation) for b in evaluation]
    assert torch.cat(gathered).tolist() == list(range(37))
    live = iter(train)
    first = next(live)
    assert accel.gather_for_metrics(ctx, first, loader=train).tolist() == first.tolist()
