"""The layout of an estimate (from a launch config, checked as `accel launch` checks it), its
distinct roles, one role's run in the fake world, and the model a command-line spec names."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from accel import config as _config
from accel._mesh import with_mesh
from accel._model_spec import first_line
from accel._options import context_values
from accel._parallelism import Parallelism
from accel.context import RunContext
from accel.estimate._fake import fake_tensors, fake_world
from accel.estimate._spec import StepSpec, Usage
from accel.estimate._step import run_steps

# Where a layout's settings come from that RunContext sets itself.
_OWN = frozenset({"device", "parallelism"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """A launch config resolved: world, mesh, the settings every rank's context carries."""

    world_size: int
    local_world_size: int
    parallelism: Parallelism
    strategy: str
    precision: str
    settings: tuple[tuple[str, Any], ...]
    """RunContext fields from the config (precision, fsdp, activation_checkpointing, ...)."""


def layout(config: _config.Config | str | os.PathLike[str] | None) -> Layout:
    """Resolve `config` as `accel launch` and `init_distributed` would; refuse what cannot run."""
    if config is None:
        config = _config.Config()
    elif not isinstance(config, _config.Config):
        config = _config.load_config(config)  # a YAML file, checked as accel launch checks it
    if config.num_processes % config.num_machines:
        raise ValueError(
            f"num_processes={config.num_processes} is not divisible by "
            f"num_machines={config.num_machines}; num_processes counts processes over all "
            "machines (as in Accelerate's config)."
        )
    settings = _config.resolve_settings({}, {}, config)
    world = config.num_processes
    sizes = settings.get("parallelism", (Parallelism(dp_replicate=world), ""))[0]
    resolved = sizes.resolve(world)  # the error accel launch gives for sizes that do not fill
    values = {k: v for k, (v, _) in settings.items() if k not in _OWN}
    if values.get("precision") == "fp8":
        raise NotImplementedError(
            "estimate_memory: mixed_precision='fp8' (torchao's float8 Linear layers) is not "
            "estimated; estimate with bf16 (the layers around float8 matmuls are bf16), "
            "--mixed_precision bf16."
        )
    return Layout(
        world_size=world,
        local_world_size=world // config.num_machines,
        parallelism=resolved,
        strategy=_strategy(resolved, values),
        precision=str(values.get("precision", "fp32")),
        settings=tuple(sorted(values.items())),
    )


def _strategy(p: Parallelism, values: dict[str, Any]) -> str:
    if values.get("deepspeed") is not None:
        return "deepspeed"
    sharded = p.dp_shard > 1 or p.cp > 1
    data = ("hsdp" if p.dp_replicate > 1 else "fsdp2") if sharded else (
        "ddp" if p.dp_replicate > 1 else "none")  # fmt: skip
    if p.tp > 1:
        data = "tp" if data == "none" else f"{data}+tp"
    return f"pp+{data}" if p.pp > 1 else data


def rank_groups(layout: Layout) -> Iterator[tuple[int, ...]]:
    """The ranks of each distinct role: each pp rank's (its stages differ), else every rank."""
    p, world = layout.parallelism, layout.world_size
    per_stage = world // p.pp  # pp is the outermost mesh dimension: pp rank r's ranks are a run
    for pp_rank in range(p.pp):
        yield tuple(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))


def check_microbatches(microbatches: Any, batch: Any) -> None:
    """Refuse microbatches that are not a count, or that do not divide a batch of that shape."""
    if microbatches is None:
        return
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"estimate_memory: microbatches={microbatches!r} must be an int >= 1 (the "
            "microbatches a pipeline step splits the batch into), e.g. microbatches=4."
        )
    if isinstance(batch, tuple) and batch and batch[0] % microbatches:
        raise ValueError(
            f"estimate_memory: microbatches={microbatches} does not divide the batch's "
            f"{batch[0]} rows (batch={batch!r}); use a batch of a multiple of {microbatches} "
            "rows, or microbatches dividing it."
        )


def context(layout: Layout, rank: int) -> RunContext:
    """Rank `rank`'s context in the fake world, its mesh built (a process group must exist)."""
    local = layout.local_world_size
    ctx = RunContext(
        rank=rank, local_rank=rank % local, world_size=layout.world_size,
        local_world_size=local, node_rank=rank // local,
        num_nodes=layout.world_size // local, device=torch.device("cpu"),
        **context_values(dict(layout.settings)),
    )  # fmt: skip
    if layout.world_size == 1:
        return replace(ctx, parallelism=layout.parallelism)
    return with_mesh(ctx, layout.parallelism, source="estimate_memory")


def estimate_rank(layout: Layout, rank: int, spec: StepSpec, *, round_to: int) -> Usage:
    """Rank `rank`'s steps on fake tensors in a fake world of the layout's size."""
    deepspeed = layout.strategy == "deepspeed"
    with (
        warnings.catch_warnings(),
        fake_world(rank, layout.world_size),
        fake_tensors(zero_reads=deepspeed),
    ):
        # DeepSpeed checks its partitions' alignment by address, which fake tensors do not have
        # (torch warns; the check passes, as it does for the real, aligned partitions)
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        try:
            guarded = replace(spec, build=functools.partial(_build_fake, spec.build))
            return run_steps(context(layout, rank), guarded, round_to=round_to)
        except _fake_errors() as err:
            raise ValueError(_data_dependent(err)) from err


def _build_fake(build: Callable[[], nn.Module]) -> nn.Module:
    """The model, built on fake tensors; a constructor that reads tensor values cannot be."""
    caught: tuple[type[BaseException], ...] = (RuntimeError, *_fake_errors())
    try:
        return build()
    except caught as err:
        raise ValueError(
            f"estimate_memory: the model could not be built on fake tensors: "
            f"{first_line(err)}; build it from shapes only (no .item(), .tolist() or .numpy() "
            "of float tensors, no weights read from files in the constructor: load them after)."
        ) from err


def _fake_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    return (
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
    )


def _data_dependent(err: BaseException) -> str:
    op = getattr(err, "func", None)
    what = str(op) if op is not None else type(err).__name__
    return (
        f"estimate_memory: the step reads values from the data ({what}), and the estimate "
        "runs on tensors that hold shapes only; make the model's shapes independent of the "
        "values (no .item(), nonzero or boolean indexing on float tensors in forward), or "
        "estimate with a model that does not."
    )
