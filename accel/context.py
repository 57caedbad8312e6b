"""`RunContext`: the one immutable value that says where and how this process runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, get_args

import torch
from typing_extensions import Self

from accel._device import default_device
from accel._options import WrapDefaults
from accel._parallelism import DATA_DIMS, MESH_DIMS, MeshDim, Parallelism, slice_mesh
from accel._typing import Backend, Precision

__all__ = ["Parallelism", "RunContext", "WrapDefaults", "along"]


_CPU = torch.device("cpu")
_NO_DEFAULTS = WrapDefaults()  # frozen: one shared value is safe
_WRAP_FIELDS = tuple(f.name for f in dataclasses.fields(WrapDefaults))
"""RunContext's fields of old (fsdp, compile, ...), now WrapDefaults' in `ctx.wrap`."""


def _moved(name: str, where: str) -> str:
    return (
        f"RunContext: {where} is now a field of `wrap`: write "
        f"{'ctx.wrap.' + name if where.startswith('ctx.') else f'wrap=WrapDefaults({name}=...)'}"
        " (accel.WrapDefaults: what wrap_model applies when its call does not say)."
    )


def _check_index(name: str, value: int, bound_name: str, bound: int) -> None:
    if not 0 <= value < bound:
        raise ValueError(
            f"RunContext: {name}={value!r} must be in [0, {bound_name}={bound}). Build contexts "
            "with accel.init_distributed(), or pass values that agree with each other."
        )


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RunContext: {name}={value!r} must be an int >= 1.")


def _check_timeout(value: Any) -> None:
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(
            f"RunContext: timeout={value!r} must be a datetime.timedelta or None, e.g. "
            "timeout=timedelta(minutes=10)."
        )
    if value is not None and value <= timedelta(0):
        raise ValueError(
            f"RunContext: timeout={value!r} must be positive (how long a collective may wait); "
            "pass e.g. timeout=timedelta(minutes=10), or None for torch's default."
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunContext:
    """Configuration and topology of one process of a run. Immutable.

    Change a field with `dataclasses.replace(ctx, precision="bf16")`. In a real run it comes from
    `accel.init_distributed()`; in tests build it directly, for any rank and world size, since
    only collectives need the process group.

    Example:
        >>> from accel import RunContext
        >>> ctx = RunContext(rank=3, world_size=4, local_rank=3, local_world_size=4)
        >>> ctx.is_main, ctx.is_distributed
        (False, True)
        >>> import dataclasses
        >>> dataclasses.replace(ctx, precision="bf16").precision
        'bf16'
    """

    rank: int = 0
    """Index of this process among all processes, in [0, world_size)."""
    local_rank: int = 0
    """Index of this process on its machine; picks the GPU."""
    world_size: int = 1
    """Number of processes in the run."""
    local_world_size: int = 1
    """Number of processes on this machine."""
    node_rank: int = 0
    """Index of this machine, in [0, num_nodes)."""
    num_nodes: int = 1
    """Number of machines."""
    device: torch.device = _CPU
    """Where this process computes (a string such as "cuda:1" is accepted and converted)."""
    backend: Backend | None = None
    """The torch.distributed backend of `process_group`; None when there is none."""
    precision: Precision = "fp32"
    """Mixed precision: "fp32" (off), "bf16" or "fp16" autocast over fp32 weights, or "fp8"
    (torchao float8 Linear layers through `wrap_model`, bf16 autocast for the rest)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    seed: int | None = None
    """Base seed of the run, if one was configured."""
    timeout: timedelta | None = None
    """How long a collective may wait before failing (the process group's timeout)."""
    process_group: Any = None
    """The torch.distributed ProcessGroup collectives run on. None means torch's default group
    (as `group=None` does in torch.distributed), which is what `init_distributed` and
    `run_world` use; pass a sub-group (held by reference) to run on part of the world."""
    parallelism: Parallelism | None = None
    """Sizes of the mesh dimensions (a -1 is filled from world_size). None: pure data
    parallelism, every rank a replica (dp_replicate = world_size)."""
    mesh: Any = None
    """The torch DeviceMesh of `parallelism` (held by reference), its dimensions named after
    the sizes > 1; `init_distributed(parallelism=...)` builds it. None for plain data
    parallelism and for hand-built contexts (the coordinates below need no mesh)."""
    wrap: WrapDefaults = _NO_DEFAULTS
    """What `wrap_model` applies when its call does not say (FSDP2 options, activation
    checkpointing, compile, DeepSpeed): the launcher config's choices."""
    log_with: tuple[str, ...] = ()
    """Tracker names a launcher config asked for (Accelerate's `log_with`); `init_trackers`
    builds them when given names=None."""
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    """Where each value came from ("argument", "env ACCEL_PRECISION", ...), for describe()."""

    def __new__(cls, *args: Any, **fields: Any) -> Self:
        # The old fields (fsdp=, compile=, ...) are refused naming their new spelling, rather
        # than by Python's bare "unexpected keyword argument".
        moved = [name for name in _WRAP_FIELDS if name in fields]
        if moved:
            raise TypeError(_moved(moved[0], f"{moved[0]}="))
        return object.__new__(cls)

    def __getattr__(self, name: str) -> Any:
        # Only for a name that is not an attribute: ctx.compile of old says where it went.
        if name in _WRAP_FIELDS:
            raise AttributeError(_moved(name, f"ctx.{name}"))
        raise AttributeError(f"'RunContext' object has no attribute {name!r}")

    def __post_init__(self) -> None:
        for name in ("world_size", "local_world_size", "num_nodes", "grad_accum_steps"):
            _check_positive(name, getattr(self, name))
        _check_index("rank", self.rank, "world_size", self.world_size)
        _check_index("local_rank", self.local_rank, "local_world_size", self.local_world_size)
        _check_index("node_rank", self.node_rank, "num_nodes", self.num_nodes)
        if self.precision not in get_args(Precision):
            raise ValueError(
                f"RunContext: precision={self.precision!r} is not supported; expected one of "
                f"{get_args(Precision)}. (Accelerate's 'no' is spelled 'fp32' here.)"
            )
        if self.backend is not None and self.backend not in get_args(Backend):
            raise ValueError(
                f"RunContext: backend={self.backend!r} is not supported; expected one of "
                f"{get_args(Backend)} or None."
            )
        device: Any = self.device  # strings are accepted at run time though typed as device
        if isinstance(device, str):
            object.__setattr__(self, "device", torch.device(device))
        elif not isinstance(device, torch.device):
            raise TypeError(
                f"RunContext: device={self.device!r} must be a torch.device or a string such as "
                "'cpu' or 'cuda:0'."
            )
        if self.parallelism is not None:
            if not isinstance(self.parallelism, Parallelism):
                raise TypeError(
                    f"RunContext: parallelism={self.parallelism!r} must be an "
                    "accel.Parallelism, e.g. Parallelism(dp_shard=2, tp=2)."
                )
            object.__setattr__(self, "parallelism", self.parallelism.resolve(self.world_size))
        _check_timeout(self.timeout)
        if not isinstance(self.wrap, WrapDefaults):
            raise TypeError(
                f"RunContext: wrap={self.wrap!r} must be an accel.WrapDefaults, e.g. "
                "wrap=WrapDefaults(compile=True)."
            )
        if not isinstance(self.log_with, tuple) or not all(
            isinstance(n, str) for n in self.log_with
        ):
            raise TypeError(
                f"RunContext: log_with={self.log_with!r} must be a tuple of tracker names, "
                "e.g. ('wandb',)."
            )
        if not isinstance(self.sources, MappingProxyType):
            object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @classmethod
    def single(cls, **fields: Any) -> Self:
        """Build the context of a one-process run, on the best local device unless told.

        Example:
            >>> RunContext.single(device="cpu", precision="bf16").world_size
            1
        """
        if "device" not in fields:
            fields["device"] = default_device(0)
        return cls(**fields)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that writes files and logs."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each machine."""
        return self.local_rank == 0

    @property
    def is_last(self) -> bool:
        """True on the last global rank, `world_size - 1` (rank 0 on one process)."""
        return self.rank == self.world_size - 1

    @property
    def is_distributed(self) -> bool:
        """True when the run has more than one process."""
        return self.world_size > 1

    @property
    def pp_rank(self) -> int:
        """This rank's index in its pipeline-parallel group (which stage(s) it holds)."""
        return _coordinate(self, "pp")[0]

    @property
    def pp_size(self) -> int:
        """Ranks the model's pipeline stages are spread over."""
        return _coordinate(self, "pp")[1]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (dp_replicate x dp_shard x ep)."""
        return _coordinate(self, "dp")[0]

    @property
    def dp_size(self) -> int:
        """Ranks that see different data; tensor-, context- and sequence-parallel peers share
        theirs (sp peers each take a slice of its sequence)."""
        return _coordinate(self, "dp")[1]

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return _coordinate(self, "tp")[0]

    @property
    def tp_size(self) -> int:
        """Ranks each tensor-parallel layer is split over."""
        return _coordinate(self, "tp")[1]

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group."""
        return _coordinate(self, "cp")[0]

    @property
    def cp_size(self) -> int:
        """Ranks a sequence is split over."""
        return _coordinate(self, "cp")[1]

    @property
    def sp_rank(self) -> int:
        """This rank's index in its sequence-parallel group: which slice of the sequence."""
        return _coordinate(self, "sp")[0]

    @property
    def sp_size(self) -> int:
        """Ranks a sequence is split over by Ulysses sequence parallelism."""
        return _coordinate(self, "sp")[1]

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group: which block of the experts it holds."""
        return _coordinate(self, "ep")[0]

    @property
    def ep_size(self) -> int:
        """Ranks the experts of each mixture-of-experts layer are split over."""
        return _coordinate(self, "ep")[1]

    def describe(self) -> str:
        """Return every effective setting, one a line, with where its value came from.

        Example:
            >>> print(RunContext(precision="bf16", sources={"precision": "argument"}).describe())
            ... # doctest: +ELLIPSIS
            rank             = 0 ...
            precision        = 'bf16'  (argument)
            ...
        """
        lines = []
        for f in dataclasses.fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            if f.name == "process_group" and value is not None:
                value = f"<{type(value).__name__}>"
            elif f.name == "mesh" and value is not None:
                dims = zip(value.mesh_dim_names or (), value.shape, strict=True)
                value = f"<DeviceMesh {' x '.join(f'{n}={s}' for n, s in dims)}>"
            shown = str(value) if isinstance(value, str) and value.startswith("<") else repr(value)
            source = self.sources.get(f.name) or _parts_source(self, f.name) or "constructed"
            lines.append(f"{f.name:<16} = {shown}  ({source})")
        return "\n".join(lines)


def _parts_source(ctx: RunContext, name: str) -> str:
    """Where the parts of a field came from ("env ACCEL_COMPILE, env ACCEL_COMPILE_DYNAMIC"):
    `wrap`'s are set one by one, each with its own source."""
    if name != "wrap":
        return ""
    return ", ".join(dict.fromkeys(ctx.sources[n] for n in _WRAP_FIELDS if n in ctx.sources))


def _sizes(ctx: RunContext) -> tuple[int, ...]:
    if ctx.parallelism is None:
        return Parallelism(dp_replicate=ctx.world_size).sizes
    return ctx.parallelism.sizes


def _coordinate(ctx: RunContext, dim: str) -> tuple[int, int]:
    """(index along `dim`, size of `dim`) for ctx.rank, row-major over the mesh dimensions."""
    sizes = _sizes(ctx)
    if dim == "dp":  # row-major over the data dimensions
        rank, size = 0, 1
        for name in DATA_DIMS:
            index, n = _coordinate(ctx, name)
            rank, size = rank * n + index, size * n
        return rank, size
    axis = MESH_DIMS.index(dim)
    inner = 1
    for size in sizes[axis + 1 :]:
        inner *= size
    return (ctx.rank // inner) % sizes[axis], sizes[axis]


def _submesh(ctx: RunContext, dim: str) -> Any:
    key = dim
    if dim == "dp":  # flattened only when two parts are > 1; otherwise it is the one that is
        parts = [n for n in DATA_DIMS if _coordinate(ctx, n)[1] > 1]
        key = "dp" if len(parts) > 1 else parts[0]
    try:
        return slice_mesh(ctx.mesh, ctx.parallelism or Parallelism(), (key,))
    except (KeyError, RuntimeError) as err:
        raise RuntimeError(
            f"along: dim={dim!r} (size {_coordinate(ctx, dim)[1]}) has no group in the "
            f"context's mesh={ctx.mesh!r}. Build the context with "
            "accel.init_distributed(parallelism=...) (or run_world(..., parallelism=...))."
        ) from err


def along(ctx: RunContext, dim: MeshDim) -> RunContext:
    """Return the context of one mesh dimension: its coordinates and its process group.

    The result's `rank` and `world_size` (and `local_rank`, `local_world_size`) are this rank's
    index along `dim` and the size of `dim`; its `process_group` is that dimension's group, so
    every collective works on it unchanged: `accel.reduce(along(ctx, "dp"), loss, op="mean")`
    averages over the ranks that saw different data. Dimensions: "pp", "dp" (dp_replicate x
    dp_shard x ep), "dp_replicate", "dp_shard", "ep", "cp", "sp", "tp".

    Args:
        ctx: a context, from `init_distributed(parallelism=...)` when collectives will run on
            a dimension smaller than the world.
        dim: the mesh dimension.

    Returns:
        A context whose world is the ranks that differ from this one only along `dim`.

    A hand-built context without a mesh gets the coordinates and `process_group=None`;
    collectives on it then fail, naming the mismatch, unless the dimension spans the world.

    Raises:
        ValueError: for an unknown `dim`.
        TypeError: when `ctx` is not a RunContext.

    Example:
        >>> from accel import along, Parallelism, RunContext
        >>> ctx = RunContext(rank=3, world_size=4, parallelism=Parallelism(dp_shard=2, tp=2))
        >>> along(ctx, "tp").rank, along(ctx, "dp").rank, ctx.dp_size
        (1, 1, 2)
    """
    if not isinstance(ctx, RunContext):
        raise TypeError(
            f"along: ctx={ctx!r} must be a RunContext (from accel.init_distributed()), e.g. "
            'along(ctx, "tp").'
        )
    if dim not in ("dp", *MESH_DIMS):
        raise ValueError(
            f"along: dim={dim!r} is not a mesh dimension; expected one of {('dp', *MESH_DIMS)}."
        )
    rank, size = _coordinate(ctx, dim)
    sources = {**ctx.sources, "rank": f"along {dim!r}", "world_size": f"along {dim!r}"}
    if size == ctx.world_size and ctx.parallelism is None:
        return ctx  # pure data parallelism: "dp" is the context itself (no copy per call)
    if size == ctx.world_size:  # the whole world: same ranks, same group
        mesh = ctx.mesh if ctx.mesh is None or ctx.mesh.ndim == 1 else _submesh(ctx, dim)
        return dataclasses.replace(ctx, parallelism=None, mesh=mesh, sources=sources)
    group, mesh, backend = None, None, None
    if size > 1 and ctx.mesh is not None:
        mesh = _submesh(ctx, dim)
        group, backend = mesh.get_group(), ctx.backend
    return dataclasses.replace(
        ctx,
        rank=rank,
        local_rank=rank,
        world_size=size,
        local_world_size=size,
        node_rank=0,
        num_nodes=1,
        backend=backend,
        process_group=group,
        parallelism=None,
        mesh=mesh,
        sources=sources,
    )
