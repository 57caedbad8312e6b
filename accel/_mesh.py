"""Build the `DeviceMesh` of a `Parallelism` over the default process group."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from accel._parallelism import DATA_DIMS, SHARD_DIMS
from accel.context import Parallelism, RunContext


def flat_dims(parallelism: Parallelism, dims: tuple[str, ...]) -> tuple[str, ...]:
    """The dimensions among `dims` of size > 1, in mesh order."""
    return tuple(n for n in dims if getattr(parallelism, n) > 1)


def shard_mesh_name(parallelism: Parallelism) -> str | None:
    """The mesh dimension FSDP2 shards replicated parameters over: dp_shard, ep, cp and sp
    together (the one of size > 1, or their flattening); None when all are 1.

    Example:
        >>> shard_mesh_name(Parallelism(dp_shard=2, sp=2)), shard_mesh_name(Parallelism(sp=2))
        ('dp_shard_sp', 'sp')
    """
    dims = flat_dims(parallelism, SHARD_DIMS)
    if not dims:
        return None
    if len(dims) > 1 and dims == flat_dims(parallelism, DATA_DIMS):
        return "dp"  # the same ranks as the data dimensions: one flattened group serves both
    return "_".join(dims)


def check_cp(
    owner: str, parallelism: Parallelism, device_type: str, *, arg: str = "parallelism"
) -> None:
    """Refuse context parallelism where torch has no implementation to run it; the error names
    `owner` and the argument `arg` that carried the Parallelism."""
    if parallelism.cp > 1 and device_type != "cuda":
        # torch's context_parallel rewrites SDPA into ring attention over the CUDA flash and
        # efficient kernels. On torch 2.13's CPU build it fails with "Operator
        # aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
        # strategy registered" (checked with gloo at 2 ranks), so cp is refused up front.
        raise NotImplementedError(
            f"{owner}: {arg}.cp={parallelism.cp} needs CUDA devices (torch's "
            "context_parallel ring attention runs on the CUDA SDPA kernels only); this run is "
            f"on {device_type!r}. Use cp=1 here (fold those ranks into dp_shard or tp)."
        )


def with_mesh(ctx: RunContext, parallelism: Parallelism, *, source: str) -> RunContext:
    """Return `ctx` with `parallelism` resolved and its DeviceMesh built (a collective).

    The mesh has one dimension per size > 1, named as in `Parallelism`, plus the flattened
    "dp" (dp_replicate x dp_shard x ep) when two of those are > 1 and the flattening of the
    dimensions FSDP2 shards over (dp_shard, ep, cp, sp: "dp_shard_cp", "dp_shard_sp", ...) when
    two of those are, the dimensions FSDP2 and `along(ctx, "dp")` use, and "stage" (every
    dimension but pp) when pp > 1 and several others are: the ranks that hold the same pipeline
    stage. Every rank must call it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    resolved = parallelism.resolve(ctx.world_size)
    check_cp("init_distributed", resolved, ctx.device.type)
    sources = {**ctx.sources, "parallelism": source, "mesh": source}
    names = resolved.names()
    if not names:
        return dataclasses.replace(ctx, parallelism=resolved, sources=sources)
    if ctx.process_group is not None or not dist.is_initialized():
        raise RuntimeError(
            "init_distributed: a DeviceMesh is built over torch's default process group, and "
            f"this context has process_group={ctx.process_group!r} (initialised: "
            f"{dist.is_initialized()}). Build meshes from the whole world's context."
        )
    shape = tuple(getattr(resolved, n) for n in names)
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    data = flat_dims(resolved, DATA_DIMS)
    if len(data) > 1:
        mesh[data]._flatten("dp")
    shard = flat_dims(resolved, SHARD_DIMS)
    if len(shard) > 1 and shard_mesh_name(resolved) != "dp":
        mesh[shard]._flatten("_".join(shard))
    if resolved.pp > 1 and len(names) > 2:
        mesh[names[1:]]._flatten("stage")
    return dataclasses.replace(ctx, parallelism=resolved, mesh=mesh, sources=sources)
