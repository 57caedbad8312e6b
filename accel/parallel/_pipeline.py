"""Pipeline parallelism: cut a model into stages over the mesh's pp dimension and run a schedule.

`pipeline_stages` keeps this rank's stage(s) of the model and builds one of
`torch.distributed.pipelining`'s schedules over them; `pipeline_step` runs one optimizer step's
forward and backward over microbatches and returns the loss on every rank of the pp group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from accel.context import RunContext, along
from accel.parallel import _schedule, _stages

__all__ = ["PipelineStages", "pipeline_stages", "pipeline_step"]

ScheduleName = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"
]
# name -> (torch's class in torch.distributed.pipelining.schedules, stage layout). "single":
# one stage per rank; "loop": stages r, r + pp, r + 2 pp, ... (round robin); "v": stages r and
# 2 pp - 1 - r (the V shape the zero-bubble V schedules require: the last stage on rank 0).
_SCHEDULES = MappingProxyType(
    {
        "gpipe": ("ScheduleGPipe", "single"),
        "1f1b": ("Schedule1F1B", "single"),
        "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
        "looped_bfs": ("ScheduleLoopedBFS", "loop"),
        "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
        "zbv": ("ScheduleZBVZeroBubble", "v"),
        "dualpipev": ("ScheduleDualPipeV", "v"),
    }
)


@dataclass(frozen=True, slots=True)
class PipelineStages:
    """This rank's pipeline stages and the schedule that runs them (from `pipeline_stages`).

    Give `parameters()` to the optimizer; pass the value to `pipeline_step`, `clip_grad_norm_`
    (as `stages.parameters()`) and `save_state` (as `stages.model`).
    """

    modules: tuple[nn.Module, ...]
    """This rank's stage modules (wrapped by `wrap=` when given), in stage order."""
    model: nn.Module
    """This rank's stages as one module under the whole model's names (sharing their
    tensors): what `save_state` / `load_state` take, so a checkpoint holds every stage's
    parameters by fully qualified name and loads at another pp size, or into the whole model."""
    stage_ids: tuple[int, ...]
    """The index of each module's stage among all `num_stages`."""
    num_stages: int
    """Stages of the whole model (pp size x stages per rank)."""
    microbatches: int
    """Microbatches each `pipeline_step` splits the batch into."""
    schedule: Any
    """The torch.distributed.pipelining schedule object (held by reference); None at pp=1,
    where `pipeline_step` runs the microbatches one after the other itself."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """The user's loss function, `loss_fn(output, target)`."""
    last_stage_rank: int
    """The pp rank holding the last stage (pp_size - 1, or 0 for the V schedules)."""

    @property
    def has_first(self) -> bool:
        """Whether this rank holds the first stage (it reads the inputs)."""
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_ids

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages, for the optimizer."""
        for module in self.modules:
            yield from module.parameters()


def available_schedules() -> tuple[str, ...]:
    """The schedule names this torch has (dualpipev came in later than the others)."""
    from torch.distributed.pipelining import schedules

    return tuple(n for n, (cls, _) in _SCHEDULES.items() if hasattr(schedules, cls))


def stage_ids(layout: str, pp_rank: int, pp_size: int, stages_per_rank: int) -> tuple[int, ...]:
    """The stages a rank holds: round robin for "loop", the V shape for "v".

    Example:
        >>> stage_ids("loop", 1, 4, 2), stage_ids("v", 1, 4, 2)
        ((1, 5), (1, 6))
    """
    if layout == "v":
        return (pp_rank, 2 * pp_size - 1 - pp_rank)
    return tuple(pp_rank + k * pp_size for k in range(stages_per_rank))


def _check(ctx: RunContext, schedule: Any, microbatches: Any) -> str:
    fn = "pipeline_stages"
    if not isinstance(ctx, RunContext):
        raise TypeError(f"{fn}: ctx={ctx!r} must be a RunContext (from accel.init_distributed()).")
    allowed = available_schedules()
    if schedule not in allowed:
        raise ValueError(
            f"{fn}: schedule={schedule!r} is not supported with torch {torch.__version__}; "
            f"expected one of {allowed}. Use schedule='1f1b'."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"{fn}: microbatches={microbatches!r} must be an int >= 1 (each step's batch is "
            "split into that many), e.g. microbatches=4."
        )
    return _SCHEDULES[schedule][1]


def _check_per_rank(schedule: str, layout: str, per_rank: Any, why: str) -> int:
    """Stages per rank for `schedule`: 1 for one-stage schedules, 2 for V, >= 2 for loops."""
    if layout == "single":
        if per_rank in (None, 1):
            return 1
        need, fix = "1", "a multi-stage schedule such as 'interleaved_1f1b'"
    else:
        if per_rank is None:
            return 2
        ok = not isinstance(per_rank, bool) and isinstance(per_rank, int) and per_rank >= 2
        if ok and (layout == "loop" or per_rank == 2):
            return int(per_rank)
        need = "exactly 2 (the V shape)" if layout == "v" else "an int >= 2"
        fix = "a one-stage schedule ('1f1b', 'gpipe')"
    raise ValueError(
        f"pipeline_stages: schedule={schedule!r} needs {need} stage(s) per rank, and "
        f"{why}; change it, or use {fix}."
    )


def _split(
    ctx: RunContext, model: nn.Module, split_points: Any, per_rank: Any, schedule: str
) -> tuple[list[list[str]], int]:
    """The units of every stage and the number of stages per rank."""
    fn, layout = "pipeline_stages", _SCHEDULES[schedule][1]
    if split_points is None:
        per_rank = _check_per_rank(schedule, layout, per_rank, f"stages_per_rank={per_rank!r}")
        points = _stages.even_split_points(model, ctx.pp_size * per_rank, fn=fn)
        return _stages.stage_units(_stages.units(model), points, fn=fn), per_rank
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(
            f"{fn}: split_points={split_points!r} must be a sequence of module names, each "
            "starting a stage, e.g. split_points=('layers.2',)."
        )
    points = list(split_points)
    num = len(points) + 1
    if num % ctx.pp_size:
        raise ValueError(
            f"{fn}: split_points={points!r} makes {num} stages, not a multiple of "
            f"pp_size={ctx.pp_size}; give pp_size x stages_per_rank - 1 split points."
        )
    if per_rank is not None and per_rank != num // ctx.pp_size:
        raise ValueError(
            f"{fn}: stages_per_rank={per_rank!r} but split_points={points!r} makes {num} "
            f"stages over pp_size={ctx.pp_size}, {num // ctx.pp_size} a rank; give "
            f"{ctx.pp_size * per_rank - 1} split points, or drop stages_per_rank."
        )
    why = f"split_points={points!r} makes {num} stages over pp_size={ctx.pp_size}"
    per_rank = _check_per_rank(schedule, layout, num // ctx.pp_size, why)
    return _stages.stage_units(_stages.units(model), points, fn=fn), per_rank


def pipeline_stages(
    ctx: RunContext,
    model: nn.Module,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int,
    schedule: ScheduleName = "1f1b",
    split_points: tuple[str, ...] | list[str] | None = None,
    stages_per_rank: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    example_inputs: Any = None,
) -> PipelineStages:
    """Keep this rank's pipeline stage(s) of `model` and build the schedule that runs them.

    The model is seen as its units in order (its children, the container of repeated blocks
    opened into its blocks: "embed", "layers.0", ..., "norm", "head"). `split_points` names the
    unit each stage after the first starts with; None spreads the blocks evenly. Each stage is
    a skeleton of the model holding its units, `nn.Identity` in place of other stages' units
    (so a forward that applies its modules in order runs on every stage) and the blocks under
    their original names. No tensor is copied: built under `accel.init_empty_weights()` the
    stages stay on meta for `wrap_model` + `load_checkpoint_in_model` to fill slice by slice;
    built for real, drop your own reference so the other stages' weights can be freed.
    One-stage schedules ("gpipe", "1f1b") hold stage `pp_rank`; "interleaved_1f1b",
    "looped_bfs", "interleaved_zb" hold `stages_per_rank` (default 2) round robin; "zbv" and
    "dualpipev" hold two in a V (stage pp_rank and 2 pp_size - 1 - pp_rank).

    Args:
        ctx: the run's context; `ctx.pp_size` ranks share the model (its mesh's "pp" group).
        model: the whole model, real or on meta.
        loss_fn: `loss_fn(output, target) -> loss`, the mean over one microbatch; gradients
            are averaged over microbatches, so they equal those of the mean over the batch.
        microbatches: how many microbatches each `pipeline_step` splits its batch into.
        schedule: a `torch.distributed.pipelining` schedule by name (see above).
        split_points: unit names starting stages 1, 2, ...: pp_size x stages_per_rank - 1.
        stages_per_rank: stages on each rank for the multi-stage schedules (default 2).
        wrap: applied to each stage module before the schedule is built, e.g.
            `lambda m: accel.wrap_model(ctx, m)` for FSDP2 or tensor parallelism per stage.
        example_inputs: one microbatch of the first stage's inputs (a tensor or a tuple):
            every stage's input and output shapes are found from it on this rank, by one
            forward of the whole model's stages in order (under the autocast you hold), and
            given to torch's stages, which then do not learn them from their neighbours in
            the first step. None: they learn them there.

    Returns:
        `PipelineStages`: this rank's (wrapped) stage modules, their stage ids, the schedule.

    Raises:
        ValueError: an unknown schedule (naming those allowed), microbatches < 1, a split
            point naming no unit or out of order, a stage count that is not pp_size x stages
            per rank, stages per rank the schedule cannot run, more stages than blocks.
        NotImplementedError: a model holding parameters of its own above its units.

    Example:
        >>> from torch import nn
        >>> import accel
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> stages = accel.pipeline_stages(
        ...     accel.RunContext.single(device="cpu"), model, loss_fn=nn.functional.mse_loss,
        ...     microbatches=2, split_points=())  # pp_size 1: one stage, the whole model
        >>> stages.stage_ids, stages.num_stages
        ((0,), 1)
    """
    layout = _check(ctx, schedule, microbatches)
    if any(True for _ in model.parameters(recurse=False)):
        raise NotImplementedError(
            f"pipeline_stages: {type(model).__name__} holds parameters of its own (not in a "
            "child module), which no single stage can own; move them into a submodule."
        )
    per_stage, per_rank = _split(ctx, model, split_points, stages_per_rank, schedule)
    ids = stage_ids(layout, ctx.pp_rank, ctx.pp_size, per_rank)
    shapes = None
    if example_inputs is not None and ctx.pp_size > 1:  # before wrapping: plain modules
        every = [_stages.stage_module(model, units) for units in per_stage]
        example = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        shapes = _schedule.stage_shapes(every, example)
    modules = [_stages.stage_module(model, per_stage[i]) for i in ids]
    if wrap is not None:
        modules = [wrap(m) for m in modules]
    built = _schedule.build_schedule(
        ctx, modules, ids, len(per_stage), _SCHEDULES[schedule], microbatches, loss_fn,
        shapes=shapes,
    )  # fmt: skip
    mine = [unit for i in ids for unit in per_stage[i]]
    return PipelineStages(
        modules=tuple(modules),
        model=_stages.stage_module(model, mine),
        stage_ids=ids,
        num_stages=len(per_stage),
        microbatches=microbatches,
        schedule=built,
        loss_fn=loss_fn,
        last_stage_rank=0 if layout == "v" else ctx.pp_size - 1,
    )


def pipeline_step(
    ctx: RunContext, stages: PipelineStages, inputs: Any, targets: Any
) -> torch.Tensor:
    """Run forward and backward of one batch through the pipeline; return the mean loss.

    Every rank of the pp group passes the same batch (from `shard_loader`, which shards over
    dp only); the rank holding the first stage feeds `inputs`, the one holding the last stage
    scores `targets`. Gradients accumulate in the stage modules, averaged over microbatches;
    then `optimizer_step` and `zero_grad` as always.

    Args:
        ctx: the run's context, as given to `pipeline_stages`.
        stages: from `pipeline_stages`.
        inputs: the first stage's input: a tensor or a tuple of tensors (positional
            arguments), split along dimension 0 into `stages.microbatches` parts.
        targets: what `loss_fn` compares the last stage's output with, split the same way.

    Returns:
        The loss averaged over the microbatches, a 0-dim tensor on `ctx.device`, the same on
        every rank of the pp group (this data-parallel shard's loss: reduce over
        `along(ctx, "dp")` for the global one).

    Raises:
        ValueError: when `stages.microbatches` does not divide the batch.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import accel
        >>> ctx = accel.RunContext.single(device="cpu")
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> stages = accel.pipeline_stages(ctx, model, loss_fn=nn.functional.mse_loss,
        ...                                microbatches=2, split_points=())
        >>> optimizer = torch.optim.SGD(stages.parameters(), lr=0.1)
        >>> loss = accel.pipeline_step(ctx, stages, torch.ones(4, 4), torch.zeros(4, 1))
        >>> accel.optimizer_step(ctx, optimizer)
        True
        >>> optimizer.zero_grad()
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    size = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else None
    if size is None or size % stages.microbatches:
        raise ValueError(
            f"pipeline_step: inputs has batch size {size!r}, which microbatches="
            f"{stages.microbatches} does not divide; use a batch size that is a multiple of "
            f"{stages.microbatches}, or pipeline_stages(..., microbatches=...) dividing {size}."
        )
    # Contiguous: torch 2.11's stages check an input's strides against the first microbatch's,
    # so a view such as tokens[:, :-1] (strides of the longer row) is refused there.
    args = tuple(a.to(ctx.device).contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    losses: list[torch.Tensor] = []
    if stages.schedule is None:
        return _run_locally(stages, args, targets.to(ctx.device))
    if stages.has_first and stages.has_last:
        stages.schedule.step(*args, target=targets.to(ctx.device), losses=losses)
    elif stages.has_first:
        stages.schedule.step(*args)
    elif stages.has_last:
        stages.schedule.step(target=targets.to(ctx.device), losses=losses)
    else:
        stages.schedule.step()
    loss = torch.zeros((), device=ctx.device)
    if stages.has_last:
        loss = torch.stack([x.detach().float() for x in losses]).mean()
    if ctx.pp_size > 1:
        _share_loss(ctx, stages, loss)
    return loss


def _share_loss(ctx: RunContext, stages: PipelineStages, loss: torch.Tensor) -> None:
    """Broadcast the last stage's loss over the pp group, into `loss` on the other ranks.

    Blocking on every rank, the last stage's included: a send still in flight when its rank
    ended the group (after a run's last step) reset the connection the first stage was reading.
    Its cost, the last stage's optimizer step waiting for the first stage's last backward, did
    not show in the pipeline benchmark (docs/benchmarks.md). Receipts posted before the step
    would keep that overlap on gloo; on NCCL such a broadcast, queued on a stream ahead of the
    schedule's sends, could hold them back (not tried: a pipeline needs several GPUs).
    """
    pp = along(ctx, "pp")
    owner = stages.last_stage_rank
    src = owner if pp.process_group is None else dist.get_global_rank(pp.process_group, owner)
    dist.broadcast(loss, src=src, group=pp.process_group)


def _run_locally(stages: PipelineStages, args: tuple[Any, ...], targets: Any) -> torch.Tensor:
    """The pipeline on one rank: each microbatch through the stages in order, its mean loss's
    backward scaled by 1/microbatches (the gradient torch's schedules give with scale_grads)."""
    order = [m for _, m in sorted(zip(stages.stage_ids, stages.modules, strict=True))]
    n = stages.microbatches
    chunks = [torch.tensor_split(a, n) if isinstance(a, torch.Tensor) else [a] * n for a in args]
    total = torch.zeros((), device=targets.device)
    for i, target in enumerate(torch.tensor_split(targets, n)):
        out = order[0](*(c[i] for c in chunks))
        for module in order[1:]:
            out = module(*out) if isinstance(out, tuple) else module(out)
        loss = stages.loss_fn(out, target)
        torch.autograd.backward(loss / n)
        total += loss.detach().float()
    return total / n
