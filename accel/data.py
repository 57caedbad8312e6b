"""Shard a DataLoader across ranks, resume it mid-epoch, and gather evaluation results exactly.

`shard_loader(ctx, loader)` returns a `ShardedLoader` that iterates like the DataLoader but
yields only this rank's batches (the layout of `accel._shard_plan.ShardPlan`), shuffles the same
way on every rank with a different order every epoch, and records its position so
`state_dict()` / `load_state_dict()` resume exactly where a run stopped, without reading the
samples it skips. `gather_for_metrics` gathers per-sample results from all ranks and drops the
samples that were repeated to even out the last round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
)

from accel._shard_plan import ShardBatch, ShardPlan, epoch_generator, sampler_indices
from accel._tree import flatten, send_to_device, unflatten
from accel.collectives import _pad, gather_leaves, gather_parts
from accel.context import RunContext

__all__ = ["ShardBatch", "ShardPlan", "ShardedLoader", "gather_for_metrics", "shard_loader"]

# Layout of the last batch each rank was given: (size, padding) per rank.
Layout = tuple[tuple[int, int], ...]


class ShardedLoader:
    """This rank's part of a DataLoader; iterate it like the DataLoader.

    It is training state, like an optimizer: it knows its epoch and how many batches it has
    yielded in it. Every `iter()` starts a full pass of the current epoch, as a DataLoader's
    does; only the first one after `load_state_dict` resumes mid-epoch. `set_epoch(e)` chooses
    the epoch (the order is a function of seed and epoch); once a pass has yielded its last
    batch the epoch advances by itself. `padding` is how many samples of the batch just yielded
    repeat earlier ones (0 except in the last round with even_batches on several processes).
    """

    def __init__(
        self,
        ctx: RunContext,
        loader: DataLoader[Any],
        *,
        plan: ShardPlan,
        device_placement: bool,
        non_blocking: bool,
        seed: int,
    ) -> None:
        self._ctx = ctx
        self.loader = loader
        self.plan = plan
        # Batches come out of the DataLoader on the CPU: moving them there again is a no-op.
        self._device = ctx.device if device_placement and ctx.device.type != "cpu" else None
        self._non_blocking = non_blocking
        self._seed = seed
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self.epoch = 0
        self.position = 0  # batches yielded in this epoch
        self._resume = False  # load_state_dict: the next iter() continues from `position`
        self._pass_over = False  # the last pass ran out: this rank has no current batch
        # map-style: the epoch's plan for every rank and the index of the last yielded batch
        self._yielded: tuple[list[list[ShardBatch]], int] | None = None
        self._chunk_layout: Layout = ()  # iterable: layout of the last yielded chunk
        self._table: tuple[int, list[list[ShardBatch]]] | None = None

    # -- the plan for an epoch ---------------------------------------------------------------

    def _underlying_batches(self, epoch: int) -> list[list[int]]:
        loader = self.loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:  # batch_size=None: every sample is its own "batch"
            return [[i] for i in sampler_indices(loader.sampler, epoch, self._seed)]
        if type(batch_sampler) is BatchSampler:
            indices = sampler_indices(batch_sampler.sampler, epoch, self._seed)
            size = batch_sampler.batch_size
            batches = [indices[i : i + size] for i in range(0, len(indices), size)]
            if batch_sampler.drop_last and batches and len(batches[-1]) < size:
                batches.pop()
            return batches
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        return [[int(i) for i in b] for b in batch_sampler]

    def _all_ranks(self, epoch: int) -> list[list[ShardBatch]]:
        if self._table is None or self._table[0] != epoch:
            batches = self._underlying_batches(epoch)
            plans = [self.plan.for_rank(r).shard(batches) for r in range(self.plan.world_size)]
            self._table = (epoch, plans)
        return self._table[1]

    # -- iteration ---------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch at the next iteration.

        Setting the epoch the loader is already in changes nothing, so a resumed run's usual
        `loader.set_epoch(epoch)` at the top of its loop keeps the loaded position.
        """
        if epoch < 0:
            raise ValueError(f"set_epoch: epoch={epoch} must be >= 0.")
        if epoch != self.epoch:
            self.epoch, self.position, self._resume = epoch, 0, False

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.loader.dataset)  # type: ignore[arg-type]
            per_chunk = self._chunk_size()
            return n // per_chunk if self.plan.drop_last else math.ceil(n / per_chunk)
        return len(self._all_ranks(self.epoch)[self.plan.rank])

    def __iter__(self) -> Iterator[Any]:
        # Not a generator function: the pass starts (and the position resets) at iter() itself.
        if not self._resume:
            self.position = 0
        self._resume, self._pass_over = False, False
        return self._run_pass(self.epoch)

    def _run_pass(self, epoch: int) -> Iterator[Any]:
        if self._iterable:
            batches, total = self._iterate_iterable(), -1
        else:
            batches, total = self._iterate_map(), len(self._all_ranks(epoch)[self.plan.rank])
        ended = False
        for batch in batches:
            self.position += 1
            if self._device is not None:
                batch = send_to_device(batch, self._device, non_blocking=self._non_blocking)
            if self.position == total:
                # The last batch: the pass is complete even if nobody asks for the next one
                # (Accelerate's recipe takes exactly len(loader) batches with next()).
                self.epoch, self.position, ended = epoch + 1, 0, True
            yield batch
        if not ended:
            self.epoch, self.position = epoch + 1, 0
        self._pass_over = True

    def _iterate_map(self) -> Iterator[Any]:
        table = self._all_ranks(self.epoch)
        mine = table[self.plan.rank]
        start = self.position
        if start >= len(mine):
            return
        loader = self.loader
        # Starting a DataLoader iterator draws its workers' base seed from `generator`, which
        # is torch's global RNG when none is given: a resumed run would start its iterator at a
        # point the uninterrupted one did not and shift the dropout masks of every later step.
        # Without the user's own generator, draw it from (seed, epoch, rank) instead, which
        # also gives workers the same seeds after a resume.
        generator = loader.generator
        if generator is None:
            generator = epoch_generator(self._seed, self.epoch, self.plan.rank)
        common: dict[str, Any] = dict(
            generator=generator,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if loader.num_workers > 0:
            common["prefetch_factor"] = loader.prefetch_factor
        if loader.batch_sampler is None:
            inner = DataLoader(
                loader.dataset,
                batch_size=None,
                sampler=[b.indices[0] for b in mine[start:]],
                **common,
            )
        else:
            inner = DataLoader(
                loader.dataset, batch_sampler=[list(b.indices) for b in mine[start:]], **common
            )
        for i, batch in enumerate(inner, start):
            self._yielded = (table, i)  # the layout is worked out only when someone asks for it
            yield batch

    def _chunk_size(self) -> int:
        size = self.loader.batch_size
        if size is None:
            raise ValueError(
                "shard_loader: an iterable dataset needs a DataLoader with a batch_size; the "
                "stream is cut into chunks of world_size * batch_size."
            )
        return size if self.plan.split_batches else size * self.plan.world_size

    def _iterate_iterable(self) -> Iterator[Any]:
        """Every rank reads the whole stream and keeps its slice of each chunk (in-process)."""
        per_chunk = self._chunk_size()
        collate = self.loader.collate_fn
        n = self.plan.world_size
        first: list[Any] | None = None
        chunk: list[Any] = []
        index = 0

        def emit(chunk: list[Any], num_real: int) -> Any:
            layout = tuple(self.plan.for_rank(r).iterable_slice(chunk, num_real) for r in range(n))
            self._chunk_layout = tuple((len(part), pad) for part, pad in layout)
            return collate(layout[self.plan.rank][0])

        for element in self.loader.dataset:  # type: ignore[attr-defined]
            chunk.append(element)
            if len(chunk) < per_chunk:
                continue
            if first is None:
                first = list(chunk)
            if index >= self.position:  # resumed runs re-read the stream up to their position
                yield emit(chunk, per_chunk)
            index += 1
            chunk = []
        if chunk and not self.plan.drop_last:
            num_real = len(chunk)
            cycle = first if first is not None else list(chunk)
            while n > 1 and len(chunk) < per_chunk:  # one process: the short batch as it is
                chunk += cycle
            if index >= self.position:
                yield emit(chunk[:per_chunk], num_real)

    @property
    def _layout(self) -> Layout:
        """(size, padding) on every rank of the batch index this loader yielded last."""
        if self._iterable:
            return self._chunk_layout
        if self._yielded is None:
            return ()
        table, i = self._yielded
        return tuple((len(p[i].indices), p[i].padding) if i < len(p) else (0, 0) for p in table)

    @property
    def padding(self) -> int:
        """How many samples at the end of the last yielded batch repeat earlier ones."""
        layout = self._layout
        return layout[self.plan.rank][1] if layout else 0

    # -- checkpointing -----------------------------------------------------------------------

    def _dataset_length(self) -> int | None:
        try:
            return len(self.loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position (plain ints), plus what a resumed run must match.

        `samples` is the position in samples of the epoch taken by all ranks together, and
        `batch_size`, `world_size`, `grad_accum_steps` make the global batch: what a resume at
        another world size needs (see `load_state_dict`).
        """
        return {
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.plan.world_size,
            "dataset_length": self._dataset_length(),
            "seed": self._seed,
            "samples": self.plan.samples_before(self.position),
            "batch_size": self.plan.rank_batch_size,
            "grad_accum_steps": self._ctx.grad_accum_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next iteration yields the batch after the last one seen.

        At another data-parallel size the position is carried over in samples, which is exact
        when the global batch (per-rank batch x world size x grad_accum_steps) is unchanged:
        every optimizer step then sees the samples it saw in the uninterrupted run. A changed
        global batch is refused, naming the three numbers of both runs.
        """
        mine = self.state_dict()
        elastic = state.get("world_size") != mine["world_size"] and "samples" in state
        for key in ("dataset_length",) if elastic else ("world_size", "dataset_length"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"ShardedLoader.load_state_dict: the state was saved with {key}="
                    f"{state.get(key)!r} but this loader has {key}={mine[key]!r}; a position only "
                    "means the same batches with the same world size and dataset. Resume with "
                    "the original setting, or start the epoch afresh with set_epoch()."
                )
        position = int(state["position"])
        if elastic:
            position = _elastic_position(state, mine, self.plan)
        self.epoch, self.position = int(state["epoch"]), position
        self._seed = int(state.get("seed", self._seed))
        self._resume = True


def _elastic_position(saved: dict[str, Any], mine: dict[str, Any], plan: ShardPlan) -> int:
    """The position at this world size that has taken the saved number of samples."""
    fn = "ShardedLoader.load_state_dict"
    keys = ("batch_size", "world_size", "grad_accum_steps")
    old, new = (tuple(d[k] for k in keys) for d in (saved, mine))
    if None in old or None in new or math.prod(old) != math.prod(new):
        raise ValueError(
            f"{fn}: the global batch changed: saved with per-rank batch {old[0]} x world size "
            f"{old[1]} x grad_accum_steps {old[2]}, resumed with {new[0]} x {new[1]} x "
            f"{new[2]}; resuming at another world size is exact only when the product is the "
            "same. Choose grad_accum_steps (or the batch size) so that it is, e.g. "
            f"grad_accum_steps={_matching_accum(old, new)}."
        )
    step = plan.step_samples
    assert step is not None  # batch_size is known (checked above)
    if saved["samples"] % step:
        raise ValueError(
            f"{fn}: the state was saved after {saved['samples']} samples of the epoch, which "
            f"is not a whole number of steps of {step} samples at world size {plan.world_size}; "
            "save at an optimizer-step boundary to resume at another world size."
        )
    return int(saved["samples"]) // step


def _matching_accum(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    if None in old or None in new:
        return "(not computable: a batch sampler of varying batch sizes)"
    need, have = math.prod(old), new[0] * new[1]
    return str(need // have) if need % have == 0 else f"(none: {need} is not a multiple of {have})"


def shard_loader(
    ctx: RunContext,
    loader: DataLoader[Any],
    *,
    even_batches: bool = True,
    split_batches: bool = False,
    device_placement: bool = True,
    non_blocking: bool = False,
    seed: int | None = None,
) -> ShardedLoader:
    """Return this rank's part of `loader`, as Accelerate's `prepare_data_loader` lays it out.

    Batch k of `loader` goes to rank k mod world_size (with `split_batches`, every batch is cut in
    world_size slices instead). With `even_batches` the last round is completed with samples from
    the start of the epoch so all ranks take the same number of steps; `gather_for_metrics` drops
    those repeats. A shuffling loader (`shuffle=True`) gets the same order on every rank, from
    `seed` (default `ctx.seed`, else 0) and the epoch. Batches are moved to `ctx.device` unless
    `device_placement=False`. Map-style datasets keep the loader's workers and pin_memory;
    iterable datasets are read in the main process by every rank, each keeping its slice.

    Args:
        ctx: the run context; its rank and world size pick the batches, and `ctx.device` is
            where they go.
        loader: a torch `DataLoader`; an iterable dataset needs a `batch_size`.
        even_batches: complete the last round with samples from the start of the epoch, so
            every rank takes the same number of steps; default True.
        split_batches: cut each batch of `loader` into `world_size` slices instead of giving
            whole batches to ranks in turn; the batch size must divide evenly. Default False.
        device_placement: move each batch's tensors to `ctx.device`; default True.
        non_blocking: move them with `non_blocking=True` (useful with pinned memory); default
            False.
        seed: the shuffling seed shared by every rank; default `ctx.seed`, else 0.

    Returns:
        A `ShardedLoader` yielding this rank's batches. Each full pass advances its epoch (a
        new shuffle; `set_epoch` sets it), and `save_state` saves its position to resume
        mid-epoch.

    Raises:
        TypeError: for a `loader` that is not a torch `DataLoader`.
        ValueError: for an iterable dataset without a batch size, or `split_batches` with a
            batch size that is missing or not divisible by `world_size`.

    Example:

    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext(rank=1, world_size=2)
    >>> [b.tolist() for b in shard_loader(ctx, DataLoader(list(range(7)), batch_size=2))]
    [[2, 3], [6, 0]]
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"shard_loader: loader={type(loader).__name__} is not a torch DataLoader; wrap the "
            "dataset in torch.utils.data.DataLoader(dataset, batch_size=...)."
        )
    if isinstance(loader.dataset, IterableDataset) and loader.batch_size is None:
        raise ValueError(
            "shard_loader: an iterable dataset needs a DataLoader with a batch_size; the stream "
            "is cut into chunks of world_size * batch_size."
        )
    plan = ShardPlan.for_context(
        ctx,
        batch_size=loader.batch_size,
        split_batches=split_batches,
        even_batches=even_batches,
        # A batch sampler of its own says whether to drop the incomplete round, as Accelerate
        # reads it (the DataLoader's drop_last is False whenever batch_sampler= is given).
        drop_last=loader.drop_last or bool(getattr(loader.batch_sampler, "drop_last", False)),
    )
    if seed is None:
        seed = ctx.seed if ctx.seed is not None else 0
    return ShardedLoader(
        ctx,
        loader,
        plan=plan,
        device_placement=device_placement,
        non_blocking=non_blocking,
        seed=seed,
    )


def gather_for_metrics(ctx: RunContext, tree: Any, *, loader: ShardedLoader) -> Any:
    """Gather per-sample results of the batch `loader` just yielded; every sample counted once.

    `tree` is either a nest of tensors with the batch on dim 0 of each leaf, or a list of Python
    objects with one item per sample (decoded text). Ranks' results are concatenated in rank
    order and the repeats `shard_loader` added to even out the last round are dropped; with
    `even_batches=False`, uneven last batches are padded for the collective and trimmed after.
    Call it on every rank for every batch (also if the loop breaks early: it uses the layout of
    the batch most recently yielded). With `even_batches=False` a rank can run out of batches
    before the others; once its pass has ended it calls `gather_for_metrics(ctx, [],
    loader=loader)` for each round it lacks, and contributes nothing (docs/data.md shows the
    loop).

    Args:
        ctx: the run context.
        tree: this rank's per-sample results of the batch.
        loader: the `ShardedLoader` the batch came from.

    Returns:
        Every rank's real samples, in the structure of `tree` (a flat list for objects).

    Args:
        ctx: the run context the loader was made with.
        tree: this rank's per-sample results for the batch: a tensor, or nested tuples, lists
            and dicts of tensors, each with the batch on dim 0.
        loader: the `ShardedLoader` (from `shard_loader`) that yielded the batch.

    Returns:
        The same structure, each tensor the concatenation of every rank's samples in rank
        order, without the repeats (on one process, this rank's samples without them).

    Raises:
        TypeError: for a `loader` that is not a `ShardedLoader`, or a leaf that is not a tensor.
        ValueError: for a leaf whose dim 0 is not this rank's batch size.
        RuntimeError: before the loader has yielded a batch, when some rank has no batch in
            this round (`even_batches=False`), or when the collective fails.

    Example:

    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext.single()
    >>> loader = shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    >>> [gather_for_metrics(ctx, b * 10, loader=loader).tolist() for b in loader]
    [[0, 10], [20, 30], [40]]
    >>> [gather_for_metrics(ctx, [f"s{i}" for i in b.tolist()], loader=loader) for b in loader]
    [['s0', 's1'], ['s2', 's3'], ['s4']]
    """
    fn = "gather_for_metrics"
    if not isinstance(loader, ShardedLoader):
        raise TypeError(
            f"{fn}: loader={type(loader).__name__} is not a ShardedLoader; pass "
            "the loader returned by shard_loader, which knows which samples are repeats."
        )
    if loader._pass_over:  # past this rank's last batch: others are in a round it has no part in
        return _join_without_batch(ctx, tree, loader)
    layout = loader._layout
    if not layout:
        raise RuntimeError(
            f"{fn}: the loader has not yielded a batch yet; call it inside the "
            "loop over the loader, after each batch."
        )
    mine, pad = layout[loader.plan.rank]  # the plan holds this rank's data-parallel place
    leaves, treedef = flatten(tree)
    if isinstance(tree, list) and not all(isinstance(x, torch.Tensor) for x in leaves):
        if len(tree) != mine:  # a list of Python objects, one per sample (decoded text)
            raise ValueError(
                f"{fn}: the list of objects has {len(tree)} items but the batch has {mine} "
                "samples; pass one item per sample of the batch (e.g. one decoded string each)."
            )
        real = list(tree[: mine - pad])
        return real if loader.plan.world_size == 1 else gather_parts(ctx, real, None)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TypeError(
            f"{fn}: tree={type(tree).__name__} mixes tensors and other objects; pass a nest of "
            "tensors (batch on dim 0), or a list with one Python object per sample, e.g. "
            "list(zip(predictions, references)) for pairs of decoded strings."
        )
    for leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != mine:
            raise ValueError(
                f"{fn}: a leaf of shape {tuple(leaf.shape)} has no per-sample "
                f"dim 0 of the batch size {mine}. Per-batch values (a mean loss) are not "
                "per-sample results: use accel.reduce(ctx, value, op='mean') for those."
            )
    if loader.plan.world_size == 1:
        return unflatten(treedef, [leaf[: mine - pad] for leaf in leaves])
    if any(size == 0 for size, _ in layout):  # ranks past their last batch join with nothing
        real_leaves = [leaf[: mine - pad] for leaf in leaves]
        return gather_parts(ctx, (treedef, real_leaves), leaves[0].device if leaves else None)
    return _gather_padded(ctx, leaves, treedef, layout)


def _gather_padded(ctx: RunContext, leaves: list[Any], treedef: Any, layout: Layout) -> Any:
    """Pad every rank's batch to the longest (even_batches=False), gather the whole tree in one
    checked exchange, then keep each rank's real samples."""
    longest = max(size for size, _ in layout)
    padded = [_pad(leaf, 0, longest, 0, False) for leaf in leaves]
    hint = (
        "Every rank must pass per-sample results of the same structure, dtypes and trailing shape."
    )
    everyone = gather_leaves(ctx, "gather_for_metrics", padded, treedef, hint)
    if all(size - pad == longest for size, pad in layout):  # nothing to drop: no copy
        return unflatten(treedef, everyone)
    out = [
        torch.cat(
            [g[r * longest : r * longest + size - pad] for r, (size, pad) in enumerate(layout)]
        )
        for g in everyone
    ]
    return unflatten(treedef, out)


def _join_without_batch(ctx: RunContext, tree: Any, loader: ShardedLoader) -> Any:
    """Take part in a round this rank has no batch in: contribute nothing, get the others'."""
    leaves = flatten(tree)[0]
    passed = [x for x in leaves if not (isinstance(x, torch.Tensor) and x.ndim and not len(x))]
    out = gather_parts(ctx, None, loader._device) if loader.plan.world_size > 1 else []
    if passed:  # after the collective, so the other ranks are not left waiting
        raise ValueError(
            "gather_for_metrics: this rank's loop over the loader has ended, so it has no batch "
            "in this round, but it passed results; a rank past its last batch contributes "
            "nothing: call gather_for_metrics(ctx, [], loader=loader)."
        )
    return out
