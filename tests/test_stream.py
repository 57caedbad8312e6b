"""Iterable datasets in shard_loader at world size 1: workers, splitting, resume (data._stream).

Also torchdata's StatefulDataLoader (map-style and streamed) through save_state/load_state.

The multi-rank checks (2 and 4 ranks, uneven ends) are in tests/dist/test_stream_dist.py.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import RunContext
from tests.processes import alive, descendants
from tests.stream_datasets import (
    GenStream,
    PlainStream,
    ShardList,
    hf_stream,
    log_example,
    ragged_collate,
    reads,
    torchdata_loader,
    write_json_shards,
)

CTX = RunContext.single()


def _ids(batch: Any) -> list[int]:
    return (batch["id"] if isinstance(batch, dict) else batch).tolist()


def _dataset(kind: str, folder: Path, n: int) -> Any:
    if kind == "gen":
        return GenStream(n, str(folder))
    if kind == "shard":
        return ShardList(list(range(n)), str(folder))
    return hf_stream(write_json_shards(folder / "json", [5, 7, 3, 6]), str(folder / "cache"))


@pytest.mark.parametrize("kind", ["gen", "shard", "datasets"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_workers_read_each_sample_once(tmp_path: Path, kind: str, num_workers: int) -> None:
    n = 21
    dataset = _dataset(kind, tmp_path, n)
    loader = accel.shard_loader(
        CTX, DataLoader(dataset, batch_size=4, num_workers=num_workers), device_placement=False
    )
    got = [i for b in loader for i in _ids(b)]
    assert sorted(got) == list(range(n))
    if kind != "datasets":  # the datasets files do not log their reads; counted in the dist test
        assert reads(tmp_path) == list(range(n))  # nothing read twice, in any process
    again = [i for b in loader for i in _ids(b)]
    assert again == got  # the order is fixed for (seed, epoch, world size, workers)


def test_workers_take_turns_and_keep_their_partial_last_batch() -> None:
    loader = accel.shard_loader(CTX, DataLoader(GenStream(11), batch_size=2, num_workers=2))
    # worker 0 reads part 0 (even samples), worker 1 part 1 (odd): batches alternate.
    assert [b.tolist() for b in loader] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9]]
    dropped = accel.shard_loader(
        CTX, DataLoader(GenStream(11), batch_size=2, num_workers=2, drop_last=True)
    )
    assert [b.tolist() for b in dropped] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10]]


def _worker_pid(worker_id: int) -> None:
    folder = torch.utils.data.get_worker_info().dataset.dataset.folder
    Path(folder, f"init-{os.getpid()}").write_text(str(worker_id))


def test_worker_init_fn_and_persistent_workers(tmp_path: Path) -> None:
    loader = accel.shard_loader(
        CTX,
        DataLoader(
            GenStream(8, str(tmp_path)),
            batch_size=2,
            num_workers=2,
            persistent_workers=True,
            worker_init_fn=_worker_pid,
            prefetch_factor=1,
        ),
    )
    epochs = [[i for b in loader for i in b.tolist()] for _ in range(3)]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert len(list(tmp_path.glob("init-*"))) == 2  # two workers for all three epochs


def _run(make: Any, stops: list[int]) -> list[list[int]]:
    """Batches of one epoch, read by a fresh loader after each stop, resumed from state."""
    out: list[list[int]] = []
    state = None
    for stop in [*stops, None]:
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        for k, batch in enumerate(loader if stop != len(out) else [], start=len(out)):
            out.append(_ids(batch))
            if k + 1 == stop:
                break
        # saved as a checkpoint would keep it: a copy, not the live object
        state = copy.deepcopy(loader.state_dict())
    return out


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_twice_at_every_position_equals_the_uninterrupted_run(
    tmp_path: Path, num_workers: int
) -> None:
    def make() -> accel.ShardedLoader:
        dataset = GenStream(13, str(tmp_path))
        return accel.shard_loader(CTX, DataLoader(dataset, batch_size=2, num_workers=num_workers))

    reference = _run(make, [])
    assert sorted(i for b in reference for i in b) == list(range(13))
    for first in range(len(reference) + 1):
        second = (first + len(reference) + 1) // 2
        for f in tmp_path.glob("reads-*"):
            f.unlink()
        assert _run(make, [first, second]) == reference, (first, second)
        # The dataset resumed from its own state: what was yielded before the first stop is
        # not read again (workers may have read ahead of the stop: that is read again).
        counts = Counter(reads(tmp_path))
        assert set(counts) == set(range(13))
        assert all(counts[i] == 1 for b in reference[:first] for i in b)
        if num_workers == 0:
            assert max(counts.values()) == 1


def test_resume_without_dataset_state_rereads_once_with_a_warning(tmp_path: Path) -> None:
    def make() -> accel.ShardedLoader:
        dataset = ShardList(list(range(13)), str(tmp_path))
        return accel.shard_loader(CTX, DataLoader(dataset, batch_size=2, num_workers=2))

    reference = _run(make, [])
    with pytest.warns(UserWarning, match=r"re-reads and skips the 6 samples"):
        assert _run(make, [3]) == reference


@pytest.mark.slow
def test_resume_datasets_streaming_from_its_own_state(tmp_path: Path) -> None:
    paths = write_json_shards(tmp_path / "json", [5, 7, 3, 6])

    def make() -> accel.ShardedLoader:
        dataset = hf_stream(paths, str(tmp_path / "cache"))
        dataset = dataset.map(functools.partial(log_example, folder=str(tmp_path)))
        return accel.shard_loader(CTX, DataLoader(dataset, batch_size=2, num_workers=2))

    reference = _run(make, [])
    assert sorted(i for b in reference for i in b) == list(range(21))
    for first in range(0, len(reference) + 1, 3):
        for f in tmp_path.glob("reads-*"):
            f.unlink()
        assert _run(make, [first, first + 2]) == reference, first
        # resumed from the dataset's own state: what was yielded before the stop is not read
        # again (what the workers had read ahead of it is)
        counts = Counter(reads(tmp_path))
        assert set(counts) == set(range(21))  # every example read, and logged, at least once
        assert all(counts[i] == 1 for b in reference[:first] for i in b), first


def test_resume_needs_the_same_number_of_workers() -> None:
    loader = accel.shard_loader(CTX, DataLoader(GenStream(8), batch_size=2, num_workers=2))
    next(iter(loader))
    other = accel.shard_loader(CTX, DataLoader(GenStream(8), batch_size=2))
    with pytest.raises(ValueError, match=r"num_workers=2 .* but this loader has 1"):
        other.load_state_dict(loader.state_dict())


def test_describe_names_how_the_stream_is_read(tmp_path: Path) -> None:
    gen = accel.shard_loader(CTX, DataLoader(GenStream(4), batch_size=2, num_workers=2))
    assert "split stream, 2 worker(s) per rank: GenStream.iter_shard" in gen.describe()
    plain = accel.shard_loader(CTX, DataLoader(PlainStream(4), batch_size=2))
    assert "PlainStream has no iter_shard()/shard() method" in plain.describe()
    assert "every rank reads the whole stream" in plain.describe()
    hf = accel.shard_loader(CTX, DataLoader(_dataset("datasets", tmp_path, 0), batch_size=2))
    assert "split_dataset_by_node" in hf.describe()
    with pytest.raises(TypeError, match="depends on how the stream splits"):
        len(gen)


def test_a_stream_that_cannot_split_keeps_the_accelerate_layout() -> None:
    loader = accel.shard_loader(RunContext(rank=1, world_size=2), DataLoader(PlainStream(7), 2))
    assert [b.tolist() for b in loader] == [[2, 3], [6, 0]]


def test_union_counts_every_sample_once_under_gather_for_metrics(tmp_path: Path) -> None:
    loader = accel.shard_loader(CTX, DataLoader(GenStream(9), batch_size=4, num_workers=2))
    gathered = [accel.gather_for_metrics(CTX, b, loader=loader).tolist() for b in loader]
    assert Counter(i for g in gathered for i in g) == Counter(range(9))


def test_dispatch_at_one_rank_yields_the_loader_batches_with_their_shapes() -> None:
    plain = DataLoader(PlainStream(11), batch_size=3, collate_fn=ragged_collate)
    loader = accel.shard_loader(CTX, plain, dispatch_batches=True)
    assert [b.tolist() for b in loader] == [b.tolist() for b in plain]
    assert {b.shape[1] for b in loader} == {3, 4}  # ragged batches keep their own width
    assert "dispatch_batches=True: rank 0 reads the whole PlainStream" in loader.describe()


def test_dispatch_needs_an_iterable_dataset_without_split_batches() -> None:
    with pytest.raises(NotImplementedError, match="dispatch_batches=True works for iterable"):
        accel.shard_loader(CTX, DataLoader(list(range(4))), dispatch_batches=True)
    with pytest.raises(NotImplementedError, match="split_batches=True"):
        accel.shard_loader(
            CTX, DataLoader(PlainStream(4), batch_size=2), dispatch_batches=True, split_batches=True
        )


def test_workers_of_a_stream_that_cannot_split_are_not_silently_dropped() -> None:
    with pytest.warns(UserWarning, match=r"num_workers=2 is not used: PlainStream has no"):
        loader = accel.shard_loader(CTX, DataLoader(PlainStream(5), batch_size=2, num_workers=2))
    # read in the main process with the Accelerate layout (its last-batch padding at world
    # size 1 is issue 13's to settle, so only the real batches are checked here)
    assert [b.tolist() for b in loader][:2] == [[0, 1], [2, 3]]


def test_dispatch_resumes_by_rereading_on_rank_0() -> None:
    def make() -> accel.ShardedLoader:
        plain = DataLoader(PlainStream(11), batch_size=2, collate_fn=ragged_collate)
        return accel.shard_loader(CTX, plain, dispatch_batches=True)

    reference = _run(make, [])
    assert len(reference) == 6
    with pytest.warns(UserWarning, match="re-reading [24] rounds of 1 batches"):
        assert _run(make, [2, 4]) == reference


@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_torchdata_stateful_dataloader_resumes_at_every_position_through_save_state(
    tmp_path: Path, kind: str, num_workers: int
) -> None:
    """torchdata's real StatefulDataLoader: shard_loader saves its own position, not the inner
    loader's, and a shuffled one gets the order a DataLoader gets (from seed and epoch)."""

    def make() -> accel.ShardedLoader:
        return accel.shard_loader(CTX, torchdata_loader(kind, num_workers))

    def per_rank(loader: accel.ShardedLoader) -> Any:  # a stream's position is per rank
        return accel.PerRank(loader) if kind == "stream" else loader

    def epochs(loader: accel.ShardedLoader, head: list[list[int]]) -> list[list[list[int]]]:
        rest = [_ids(b) for b in loader]
        return [head + rest, [_ids(b) for b in loader]]  # the rest of epoch 0, then epoch 1

    reference = epochs(make(), [])
    if kind == "map":  # the order of a plain DataLoader with shuffle=True, under the same seed
        plain = DataLoader(list(range(13)), batch_size=2, shuffle=True, num_workers=num_workers)
        same = accel.shard_loader(CTX, plain)
        assert reference == [[_ids(b) for b in same] for _ in range(2)]
        assert reference[0] != reference[1]  # reshuffled each epoch
    assert sorted(i for b in reference[0] for i in b) == list(range(13))
    for stop in range(len(reference[0])):  # partway: after the last batch the epoch is over
        first = make()
        it = iter(first)
        head = [_ids(next(it)) for _ in range(stop)]
        accel.save_state(CTX, tmp_path / f"ckpt{stop}", loader=per_rank(first))
        resumed = make()
        accel.load_state(CTX, tmp_path / f"ckpt{stop}", loader=per_rank(resumed))
        assert epochs(resumed, head) == reference, stop


def test_a_fresh_pass_after_a_resume_reads_the_whole_datasets_stream(tmp_path: Path) -> None:
    paths = write_json_shards(tmp_path / "json", [5, 7, 3, 6])

    def make() -> accel.ShardedLoader:
        dataset = hf_stream(paths, str(tmp_path / "cache"))
        return accel.shard_loader(CTX, DataLoader(dataset, batch_size=2))

    first = make()
    it = iter(first)
    next(it), next(it)
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert len([i for b in resumed for i in _ids(b)]) == 17  # the rest of epoch 0
    resumed.set_epoch(0)  # the whole of epoch 0 again, not the rest of it once more
    assert sorted(i for b in resumed for i in _ids(b)) == list(range(21))


def test_a_position_saved_by_another_rank_is_refused() -> None:
    def make(rank: int) -> accel.ShardedLoader:
        return accel.shard_loader(
            RunContext(rank=rank, world_size=2), DataLoader(GenStream(8), batch_size=2)
        )

    state = {**make(0).state_dict(), "position": 1}  # as save_state stores it, from rank 0
    with pytest.raises(ValueError, match=r"saved by rank 0 but this is rank 1.*each rank's own"):
        make(1).load_state_dict(state)


def test_a_stream_that_cannot_split_resumes_by_rereading_with_a_warning() -> None:
    def make() -> accel.ShardedLoader:
        return accel.shard_loader(CTX, DataLoader(PlainStream(9), batch_size=2))

    reference = _run(make, [])
    with pytest.warns(UserWarning, match=r"re-reads the first 6 samples of PlainStream"):
        assert _run(make, [3]) == reference


@pytest.mark.parametrize(("files", "how"), [(4, "by shards: 4 shards"), (3, "by examples")])
def test_describe_says_how_a_datasets_stream_splits_at_this_world_size(
    tmp_path: Path, files: int, how: str
) -> None:
    paths = write_json_shards(tmp_path / "json", [2] * files)
    dataset = hf_stream(paths, str(tmp_path / "cache"))
    ctx = RunContext(rank=1, world_size=2)  # built by hand: nothing is read here
    loader = accel.shard_loader(ctx, DataLoader(dataset, batch_size=2))
    assert f"here {how}" in loader.describe()


def test_a_datasets_stream_the_user_split_already_is_not_split_twice(tmp_path: Path) -> None:
    from datasets.distributed import split_dataset_by_node

    paths = write_json_shards(tmp_path / "json", [2] * 4)
    ctx = RunContext(rank=1, world_size=2)
    mine = split_dataset_by_node(hf_stream(paths, str(tmp_path / "cache")), rank=1, world_size=2)
    loader = accel.shard_loader(ctx, DataLoader(mine, batch_size=2))
    assert "already split by split_dataset_by_node(rank=1, world_size=2)" in loader.describe()
    other = split_dataset_by_node(hf_stream(paths, str(tmp_path / "cache")), rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"split for rank=0, world_size=4 .* rank 1 of 2"):
        accel.shard_loader(ctx, DataLoader(other, batch_size=2))


# -- a killed rank takes its DataLoader workers with it (issue 29 item 5) ----------------------

_RANK = """
import os, sys, time
from torch.utils.data import DataLoader
import accel
from tests.stream_datasets import EndlessStream, MarkedRange

folder, kind = sys.argv[1], sys.argv[2]
dataset = EndlessStream(folder) if kind == "stream" else MarkedRange(1000, folder)
base = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="forkserver")
loader = accel.shard_loader(accel.RunContext.single(), base)
batches = iter(loader)
next(batches)
next(batches)  # the second batch comes from the second worker
open(os.path.join(folder, "ready"), "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stream", "map"])
def test_a_rank_killed_with_sigkill_leaves_no_forkserver_worker_behind(
    tmp_path: Path, kind: str
) -> None:
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": str(root)}
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path), kind], cwd=root, env=env)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and rank.poll() is None:
            assert time.monotonic() < deadline, "the rank did not read its first batches"
            time.sleep(0.1)
        assert rank.poll() is None, f"the rank exited with {rank.returncode}"
        workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
        tree = descendants(rank.pid)  # forkserver, resource tracker, the workers below them
        assert len(workers) == 2 and set(workers) <= set(tree), (workers, tree)
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        deadline = time.monotonic() + 15
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in tree if alive(p)]
        assert not left, f"processes of the killed rank's tree outlived it: {left} of {tree}"
    finally:
        for pid in [rank.pid, *tree]:  # a failed run leaves nothing behind either
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        rank.wait()
