"""`ShardedLoader`: this rank's batches of a DataLoader, an epoch at a time, resumable.

The loader keeps the epoch, the position, the resume and the device placement; what it reads
comes from one `BatchSource` (`accel.data._source`): map-style data, a whole stream, a split
stream or a dispatched stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch.utils.data import DataLoader, IterableDataset

from accel._tree import send_to_device
from accel.context import RunContext, along
from accel.data._sequence import split_sequence
from accel.data._shard_plan import ShardPlan
from accel.data._source import BatchSource, Layout, MapSource
from accel.data._stream import open_stream


class _FromUserLoader:
    """A read-only attribute of the user's DataLoader, as a prepared DataLoader exposes it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: ShardedLoader | None, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.loader, self.name)

    def __set__(self, obj: ShardedLoader, value: object) -> NoReturn:
        raise AttributeError(
            f"ShardedLoader.{self.name} is read-only: it is the {self.name} of the DataLoader "
            "given to shard_loader. Build a DataLoader with the setting you want and call "
            "shard_loader again."
        )


class ShardedLoader:
    """This rank's part of a DataLoader; iterate it like the DataLoader.

    It is training state, like an optimizer: it knows its epoch and how many batches it has
    yielded in it. Every `iter()` starts a full pass of the current epoch, as a DataLoader's
    does; only the first one after `load_state_dict` resumes mid-epoch. `set_epoch(e)` chooses
    the epoch (the order is a function of seed and epoch); once a pass has yielded its last
    batch the epoch advances by itself. `padding` is how many samples of the batch just yielded
    repeat earlier ones: 0 except in the last round with even_batches on several processes,
    where the ranks after the last real sample pad (with a split stream, the ranks whose part
    has ended); the repeats always sit at the end of the batch.

    The attributes a script reads on a prepared DataLoader are those of the DataLoader given to
    `shard_loader`, read-only: `dataset`, `batch_size`, `sampler`, `batch_sampler`,
    `num_workers`, `collate_fn`, `drop_last`, `pin_memory`, `pin_memory_device`, `timeout`,
    `worker_init_fn`, `multiprocessing_context`, `generator`, `prefetch_factor` and
    `persistent_workers` (so `len(loader.dataset)` is the whole dataset's length, as in
    Accelerate).
    """

    dataset = _FromUserLoader()
    batch_size = _FromUserLoader()
    sampler = _FromUserLoader()
    batch_sampler = _FromUserLoader()
    num_workers = _FromUserLoader()
    collate_fn = _FromUserLoader()
    drop_last = _FromUserLoader()
    pin_memory = _FromUserLoader()
    pin_memory_device = _FromUserLoader()
    timeout = _FromUserLoader()
    worker_init_fn = _FromUserLoader()
    multiprocessing_context = _FromUserLoader()
    generator = _FromUserLoader()
    prefetch_factor = _FromUserLoader()
    persistent_workers = _FromUserLoader()

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
        # Batches come out of the DataLoader on the host: moving them to a plain "cpu" device is
        # a no-op. Any other device is moved to, the device canary's cpu:0 included (which is
        # CPU memory but not the host, as a GPU would not be).
        host = ctx.device == torch.device("cpu")
        self._device = ctx.device if device_placement and not host else None
        self._non_blocking = non_blocking
        self._sp = (ctx.sp_rank, ctx.sp_size)  # sequence-parallel peers take slices of a batch
        self._seed = seed
        self.epoch = 0
        self.position = 0  # batches yielded in this epoch
        self._resume = False  # load_state_dict: the next iter() continues from `position`
        self._ended = False  # the last pass ran out: this rank has no current batch
        self._left = False  # the last pass was closed before its end (a loop's break)
        self._passes = 0  # passes started, so a closed old pass does not mark a newer one
        # Streams talk over the data-parallel group: tensor-parallel peers read the same part.
        self._source: BatchSource = (
            open_stream(along(ctx, "dp"), loader, plan, dispatch_batches)
            if isinstance(loader.dataset, IterableDataset)
            else MapSource(loader, plan)
        )

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
        return self._source.num_batches(self.epoch, seed=self._seed)

    def __iter__(self) -> Iterator[Any]:
        # Not a generator function: the pass starts (and the position resets) at iter() itself.
        if not self._resume:
            self.position = 0
        self._resume, self._ended, self._left = False, False, False
        self._passes += 1
        return self._run_pass(self.epoch, self._passes)

    def _run_pass(self, epoch: int, number: int) -> Iterator[Any]:
        source = self._source
        total = source.num_batches(epoch, seed=self._seed) if source.ends_at_count else -1
        batches = source.iterate(epoch, seed=self._seed, position=self.position)
        ended = False
        try:
            for batch in batches:
                self.position += 1
                if self._device is not None:
                    batch = send_to_device(batch, self._device, non_blocking=self._non_blocking)
                if self._sp[1] > 1:
                    batch = split_sequence(batch, *self._sp)
                if self.position == total:
                    # The last batch: the pass is complete even if nobody asks for the next one
                    # (Accelerate's recipe takes exactly len(loader) batches with next()).
                    self.epoch, self.position, ended = epoch + 1, 0, True
                yield batch
        except GeneratorExit:  # closed before its end: its batches are no longer current
            if number == self._passes and not ended:  # (a newer pass is not this one's)
                self._left = True
            raise
        if not ended:
            self.epoch, self.position = epoch + 1, 0
        self._ended = True

    @property
    def layout(self) -> Layout:
        """(size, padding) on every data-parallel rank of the batch this loader yielded last.

        Empty before the first batch. `gather_for_metrics` keeps each rank's first
        `size - padding` samples.
        """
        return self._source.layout

    @property
    def padding(self) -> int:
        """How many samples at the end of the last yielded batch repeat earlier ones."""
        layout = self.layout
        return layout[self.plan.rank][1] if layout else 0

    @property
    def pass_ended(self) -> bool:
        """True once this rank's last pass has run out of batches: it has no current batch."""
        return self._ended

    @property
    def pass_left(self) -> bool:
        """True when the last pass was closed before its end (a loop over it ended with `break`,
        or its iterator was dropped): the batch it yielded last is no longer current."""
        return self._left

    @property
    def device(self) -> torch.device | None:
        """Where batches are moved (`ctx.device`); None: left on the CPU, where they are made."""
        return self._device

    # -- checkpointing -----------------------------------------------------------------------

    @property
    def state_is_per_rank(self) -> bool:
        """True when every rank's state is its own (a stream split across ranks and workers):
        `save_state` then saves and loads each rank's copy, as `PerRank(loader)` would."""
        return self._source.state_is_per_rank

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
        own = self._source.state_dict()
        if own is not None:  # e.g. each worker's place in its part of a split stream
            state["stream"] = own
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
            and "stream" not in mine  # a source of its own state resumes where it was saved
        )
        for key in ("dataset_length",) if elastic else ("world_size", "dataset_length"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"ShardedLoader.load_state_dict: the state was saved with {key}="
                    f"{state.get(key)!r} but this loader has {key}={mine[key]!r}; a position only "
                    "means the same batches with the same world size and dataset. Resume with "
                    "the original setting, or start the epoch afresh with set_epoch()."
                )
        if "stream" in mine and int(state["position"]) > 0:
            self._source.load_state_dict(state.get("stream"))
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
        return self._source.describe()


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
