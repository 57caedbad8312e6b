"""Iterable datasets split across 2 and 4 real ranks and their DataLoader workers.

One `run_world` per world size reads every kind of splittable stream with 0, 1 and 2 workers;
the tests check the union of all ranks' samples (each exactly once), how often each sample was
read (every process logs its reads to files), that uneven ends neither hang nor lose a sample,
and that resuming twice inside an epoch, through save_state/load_state, equals the
uninterrupted run; and that torchdata's StatefulDataLoader does the same in a fresh world.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import accel
from accel.testing import run_world
from tests.stream_datasets import (
    GenStream,
    PlainStream,
    ShardList,
    hf_stream,
    ragged_collate,
    reads,
    torchdata_loader,
    write_json_shards,
)

pytestmark = pytest.mark.dist

N = 29  # samples of the generator and shard() streams: not a multiple of any batch layout
JSON_SIZES = [5, 7, 3, 6, 4, 2, 8, 1]  # 8 files: by shards at 2 and 4 ranks
JSON_ODD = [5, 7, 3]  # 3 files: by examples at 2 and 4 ranks


def _ids(batch: Any) -> Any:
    return batch["id"] if isinstance(batch, dict) else batch


def _workers() -> Any:
    """The start method for DataLoader workers in these worlds: forked from a clean server.

    A rank here has live gloo threads and, once it read a `datasets` stream, pyarrow's thread
    pool; forking such a process can deadlock the child on a lock another thread held (a CI
    run hung here once). A forkserver forks workers from a fresh single-threaded process that
    has torch and the datasets imported once, so they still start in milliseconds.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "datasets", "tests.stream_datasets"])
    return context


def _make(kind: str, folder: str, num_workers: int, **options: Any) -> Any:
    reads_dir = f"{folder}/reads-{kind}-{num_workers}"
    Path(reads_dir).mkdir(parents=True, exist_ok=True)
    if kind == "gen":
        dataset: Any = GenStream(N, reads_dir)
    elif kind == "shard":
        dataset = ShardList(list(range(N)), reads_dir)
    else:
        base = kind.removesuffix("_presplit")
        files = JSON_SIZES if base == "datasets" else JSON_ODD
        paths = sorted(str(p) for p in Path(folder, base).glob("*.jsonl"))
        assert len(paths) == len(files)
        dataset = hf_stream(paths, f"{folder}/cache")
        if kind.endswith("_presplit"):  # split by the user, as with Accelerate: not again
            from datasets.distributed import split_dataset_by_node

            rank, world_size = options.pop("rank"), options.pop("world_size")
            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    if num_workers:
        options["multiprocessing_context"] = _workers()
    return DataLoader(dataset, batch_size=3, num_workers=num_workers, **options)


def _epoch(ctx: accel.RunContext, loader: accel.ShardedLoader) -> dict[str, Any]:
    """Every rank's batches (with padding) and the gathered samples, one epoch."""
    mine, gathered = [], []
    for batch in loader:
        mine.append((_ids(batch).tolist(), loader.padding))
        gathered += accel.gather_for_metrics(ctx, _ids(batch), loader=loader).tolist()
    return {"mine": mine, "gathered": gathered}


def _exactly_once_world(ctx: accel.RunContext, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("gen", "shard", "datasets", "datasets_odd", "datasets_presplit"):
        for num_workers in (0, 1, 2):
            where = {"rank": ctx.rank, "world_size": ctx.world_size} if "presplit" in kind else {}
            loader = accel.shard_loader(ctx, _make(kind, folder, num_workers, **where))
            out[kind, num_workers] = _epoch(ctx, loader)
            out[kind, num_workers, "describe"] = loader.describe()
    # uneven parts: rank 0's parts are long, the last rank's are empty
    parts = ctx.world_size * 2
    sizes = tuple((ctx.world_size - 1 - k // 2) * 4 for k in range(parts))
    for even in (True, False):
        uneven = DataLoader(
            GenStream(200, sizes=sizes),
            batch_size=2,
            num_workers=2,
            multiprocessing_context=_workers(),
        )
        out["uneven", even] = _epoch(ctx, accel.shard_loader(ctx, uneven, even_batches=even))
    out["uneven_sizes"] = sizes
    # split_batches: the loader's batch size is the global one; each rank batches its share
    split = DataLoader(
        GenStream(N),
        batch_size=2 * ctx.world_size,
        num_workers=2,
        multiprocessing_context=_workers(),
    )
    out["split_batches"] = _epoch(ctx, accel.shard_loader(ctx, split, split_batches=True))
    for num_workers in (0, 1):  # PlainStream does not split itself: 1 worker at most
        workers = {"multiprocessing_context": _workers()} if num_workers else {}
        plain = DataLoader(
            PlainStream(N), 3, num_workers=num_workers, collate_fn=ragged_collate, **workers
        )
        loader = accel.shard_loader(ctx, plain, dispatch_batches=True)
        out["dispatch", num_workers] = [(b.tolist(), loader.padding) for b in loader]
    plain = DataLoader(PlainStream(N), 3, collate_fn=ragged_collate)
    loader = accel.shard_loader(ctx, plain, dispatch_batches=True, even_batches=False)
    out["dispatch_uneven"] = [b.tolist() for b in loader]
    return out


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"stream{request.param}")
    write_json_shards(folder / "datasets", JSON_SIZES)
    write_json_shards(folder / "datasets_odd", JSON_ODD)
    n = request.param
    return n, folder, run_world(_exactly_once_world, world_size=n, timeout=300, args=(str(folder),))


@pytest.mark.parametrize("kind", ["gen", "shard", "datasets", "datasets_odd", "datasets_presplit"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_union_of_all_ranks_is_the_stream_exactly_once(
    world: Any, kind: str, num_workers: int
) -> None:
    _, folder, results = world
    total = {"gen": N, "shard": N, "datasets": sum(JSON_SIZES), "datasets_odd": sum(JSON_ODD)}
    total["datasets_presplit"] = total["datasets"]
    ranks = [r[kind, num_workers] for r in results]
    real = [i for r in ranks for batch, pad in r["mine"] for i in batch[: len(batch) - pad]]
    assert sorted(real) == list(range(total[kind]))  # no sample twice, none missing
    assert Counter(ranks[0]["gathered"]) == Counter(range(total[kind]))  # padding dropped
    assert all(r["gathered"] == ranks[0]["gathered"] for r in ranks)
    assert len({len(r["mine"]) for r in ranks}) == 1  # every rank took the same steps
    if kind in ("gen", "shard"):  # split, not skip: each sample was read once in total
        assert reads(Path(folder, f"reads-{kind}-{num_workers}")) == list(range(N))
    describe = results[0][kind, num_workers, "describe"]
    assert f"split stream, {max(1, num_workers)} worker(s) per rank" in describe


def test_uneven_ends_pad_or_stop_together_without_a_hang(world: Any) -> None:
    _, _, results = world
    sizes = results[0]["uneven_sizes"]
    assert sizes[-1] == 0  # the last rank's parts are empty: it borrows padding
    expected = sorted(i for k, size in enumerate(sizes) for i in range(k, 200, len(sizes))[:size])
    padded = [r["uneven", True] for r in results]
    assert len({len(r["mine"]) for r in padded}) == 1
    assert sorted(padded[0]["gathered"]) == expected  # nothing lost, padding dropped
    assert padded[-1]["mine"] and all(pad == len(b) for b, pad in padded[-1]["mine"])
    stopped = [r["uneven", False] for r in results]
    assert len({len(r["mine"]) for r in stopped}) == 1  # all stop at the same step
    assert len(stopped[0]["mine"]) == 0  # the last rank has nothing: everyone stops at once


def _resume_world(ctx: accel.RunContext, folder: str, kind: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # ShardList has no state: resuming warns, by design

    def make() -> accel.ShardedLoader:
        return accel.shard_loader(ctx, _make(kind, folder, 2))

    def run(stops: list[int], tag: str) -> list[Any]:
        out: list[Any] = []
        for s, stop in enumerate([*stops, None]):
            loader = make()
            # A split stream's loader is saved per rank with or without PerRank: alternate.
            as_saved = accel.PerRank(loader) if s % 2 else loader
            if s:
                accel.load_state(ctx, f"{folder}/{tag}-{s}", loader=as_saved)
            if stop != len(out):
                for k, batch in enumerate(loader, start=len(out)):
                    out.append((_ids(batch).tolist(), loader.padding))
                    if k + 1 == stop:
                        break
            accel.save_state(ctx, f"{folder}/{tag}-{s + 1}", loader=as_saved)
        return out

    reference = run([], "ref")
    runs = {}
    for first in range(len(reference) + 1):
        second = (first + len(reference) + 1) // 2
        runs[first, second] = run([first, second], f"resume-{first}")
    return {"reference": reference, "runs": runs}


@pytest.mark.parametrize(
    ("kind", "world_size"), [("gen", 2), ("shard", 2), ("datasets", 2), ("gen", 4)]
)
def test_resume_twice_at_every_position_equals_the_uninterrupted_run(
    tmp_path: Path, kind: str, world_size: int
) -> None:
    write_json_shards(tmp_path / "datasets", JSON_SIZES)
    args = (str(tmp_path), kind)
    results = run_world(_resume_world, world_size=world_size, timeout=300, args=args)
    for rank in results:
        assert len(rank["runs"]) == len(rank["reference"]) + 1 >= 4
        for stops, got in rank["runs"].items():
            assert got == rank["reference"], stops


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dispatch_sends_rank_r_batches_r_plus_k_world_size(world: Any, num_workers: int) -> None:
    n, _, results = world
    plain = [b.tolist() for b in DataLoader(PlainStream(N), 3, collate_fn=ragged_collate)]
    rounds = -(-len(plain) // n)
    padded = plain + plain[: rounds * n - len(plain)]  # the last round lends the first batches
    for r, rank in enumerate(results):
        got = rank["dispatch", num_workers]
        assert [b for b, _ in got] == padded[r::n]  # ragged widths arrive as they were
        assert [p for _, p in got] == [
            0 if k < len(plain) else len(padded[k]) for k in range(r, rounds * n, n)
        ]


def test_split_batches_cuts_the_global_batch_size_per_rank(world: Any) -> None:
    _, _, results = world
    ranks = [r["split_batches"] for r in results]
    assert {len(b) for r in ranks for b, _ in r["mine"]} <= {1, 2}  # 2 per rank, or the tail
    real = [i for r in ranks for b, pad in r["mine"] for i in b[: len(b) - pad]]
    assert sorted(real) == list(range(N))
    assert Counter(ranks[0]["gathered"]) == Counter(range(N))


def test_dispatch_without_even_batches_stops_before_an_incomplete_round(world: Any) -> None:
    n, _, results = world
    plain = [b.tolist() for b in DataLoader(PlainStream(N), 3, collate_fn=ragged_collate)]
    full_rounds = len(plain) // n
    for r, rank in enumerate(results):
        assert rank["dispatch_uneven"] == plain[r : full_rounds * n : n]


def _torchdata_world(ctx: accel.RunContext, folder: str, phase: str) -> dict[Any, Any]:
    """torchdata's StatefulDataLoader at every stop: phase "save" runs the uninterrupted epoch
    and saves a loader stopped after each batch; phase "load" (a fresh world) resumes each."""
    out: dict[Any, Any] = {}
    for kind in ("map", "stream"):
        for num_workers in (0, 2):

            def make() -> accel.ShardedLoader:
                return accel.shard_loader(ctx, torchdata_loader(kind, num_workers))  # noqa: B023

            def saved(loader: accel.ShardedLoader) -> Any:  # a stream's position is per rank
                return accel.PerRank(loader) if kind == "stream" else loader  # noqa: B023

            case = f"{folder}/{kind}-{num_workers}"
            if phase == "save":
                reference = _epoch(ctx, make())
                out[kind, num_workers] = reference
                for stop in range(len(reference["mine"])):
                    first = make()
                    it = iter(first)
                    for _ in range(stop):
                        next(it)
                    accel.save_state(ctx, f"{case}-{stop}", loader=saved(first))
            else:
                for stop in range(len(list(Path(folder).glob(f"{kind}-{num_workers}-*")))):
                    resumed = make()
                    accel.load_state(ctx, f"{case}-{stop}", loader=saved(resumed))
                    out[kind, num_workers, stop] = _epoch(ctx, resumed)
    return out


def test_a_torchdata_stateful_dataloader_resumes_in_a_fresh_world(tmp_path: Path) -> None:
    """At 2 ranks the real StatefulDataLoader splits (each sample once) and resumes from
    save_state, in new processes, with the rest of the uninterrupted epoch at every stop."""
    saved = run_world(_torchdata_world, world_size=2, timeout=300, args=(str(tmp_path), "save"))
    loaded = run_world(_torchdata_world, world_size=2, timeout=300, args=(str(tmp_path), "load"))
    for kind in ("map", "stream"):
        for num_workers in (0, 2):
            ranks = [r[kind, num_workers] for r in saved]
            assert Counter(ranks[0]["gathered"]) == Counter(range(13)), (kind, num_workers)
            for rank, reference in enumerate(ranks):
                stops = [k for k in loaded[rank] if k[:2] == (kind, num_workers)]
                assert len(stops) == len(reference["mine"]) >= 4
                for key in stops:
                    rest = loaded[rank][key]["mine"]
                    assert rest == reference["mine"][key[2] :], (rank, key)
