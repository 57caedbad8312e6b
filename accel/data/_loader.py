"""`ShardedLoader`: this rank's batches of a DataLoader, an epoch at a time, resumable.

Map-style datasets follow `ShardPlan` (Accelerate's layout); iterable datasets either split
themselves (`accel.data._stream`) or are read whole by every rank, each keeping its slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
)

from accel._tree import send_to_device
from accel.context import RunContext, along
from accel.data._shard_plan import (
    ShardBatch,
    ShardPlan,
    epoch_generator,
    is_torch_kind,
    sampler_indices,
)
from accel.data._stream import SplitStream, describe, open_stream, warn_reread
from accel.data._workers import worker_options

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
        dispatch_batches: bool = False,
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
        # Iterable streams that split, or are dispatched, go to accel.data._stream; others below.
        # They talk over the data-parallel group: tensor-parallel peers read the same part.
        dp = along(ctx, "dp")
        opened = open_stream(dp, loader, plan, dispatch_batches) if self._iterable else None
        self._stream, self._stream_reason = opened or (None, "")

    # -- the plan for an epoch ---------------------------------------------------------------

    def _underlying_batches(self, epoch: int) -> list[list[int]]:
        loader = self.loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:  # batch_size=None: every sample is its own "batch"
            return [[i] for i in sampler_indices(loader.sampler, epoch, self._seed)]
        if is_torch_kind(batch_sampler, BatchSampler):
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
        if self._stream is not None:
            raise TypeError(
                f"len(ShardedLoader): {self._stream_reason}; how many batches each rank gets "
                "depends on how the stream splits, which is known only at its end."
            )
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
        if self._stream is not None:  # its length is known only at its end
            generator = self.loader.generator
            if generator is None:  # as in _iterate_map: workers seeded from (seed, epoch, rank)
                generator = epoch_generator(self._seed, epoch, self.plan.rank)
            batches = self._stream.iterate(epoch, position=self.position, generator=generator)
            total = -1
        elif self._iterable:
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
        common = worker_options(loader, generator) | {"collate_fn": loader.collate_fn}
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
        if self.position:  # a stream cannot seek: re-read up to the position
            warn_reread(self.loader.dataset, self.position * per_chunk)

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
        if self._stream is not None:
            return self._stream.layout
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

    @property
    def state_is_per_rank(self) -> bool:
        """True when every rank's state is its own (a stream split across ranks and workers):
        `save_state` then saves and loads each rank's copy, as `PerRank(loader)` would."""
        return isinstance(self._stream, SplitStream)

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
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.plan.world_size,
            "dataset_length": self._dataset_length(),
            "seed": self._seed,
            "samples": self.plan.samples_before(self.position),
            "batch_size": self.plan.rank_batch_size,
            "grad_accum_steps": self._ctx.grad_accum_steps,
        }
        if self._stream is not None:  # each worker's place in its part of the stream
            state["stream"] = self._stream.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next iteration yields the batch after the last one seen.

        At another data-parallel size the position is carried over in samples, which is exact
        when the global batch (per-rank batch x world size x grad_accum_steps) is unchanged:
        every optimizer step then sees the samples it saw in the uninterrupted run. A changed
        global batch is refused, naming the three numbers of both runs. A stream that splits
        itself resumes only at the world size it was saved at (each worker keeps its own place).
        """
        mine = self.state_dict()
        elastic = (
            state.get("world_size") != mine["world_size"]
            and state.get("samples") is not None
            and self._stream is None
        )
        for key in ("dataset_length",) if elastic else ("world_size", "dataset_length"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"ShardedLoader.load_state_dict: the state was saved with {key}="
                    f"{state.get(key)!r} but this loader has {key}={mine[key]!r}; a position only "
                    "means the same batches with the same world size and dataset. Resume with "
                    "the original setting, or start the epoch afresh with set_epoch()."
                )
        if self._stream is not None and int(state["position"]) > 0:
            self._stream.load_state_dict(state.get("stream"))
        position = _elastic_position(state, mine, self.plan) if elastic else int(state["position"])
        self.epoch, self.position = int(state["epoch"]), position
        self._seed = int(state.get("seed", self._seed))
        self._resume = True

    def describe(self) -> str:
        """How this loader reads its dataset on this rank (layout; how a stream is split).

        Returns:
            Lines of text: the layout settings, then how the dataset is read and why.

        Example:

        >>> from torch.utils.data import DataLoader
        >>> from accel import shard_loader
        >>> loader = shard_loader(RunContext(rank=1, world_size=2), DataLoader(range(4)))
        >>> print(loader.describe().splitlines()[0])
        rank 1 of 2, batch_size=1, even_batches=True, split_batches=False, drop_last=False
        """
        reason = self._stream_reason or f"map-style {type(self.loader.dataset).__name__}"
        return describe(self.plan, reason, self._stream)


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
