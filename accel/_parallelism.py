"""The mesh sizes of N-D parallelism (`Parallelism`).

They live below `RunContext`, which records them, and below `wrap_model`, which applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Parallelism"]

MeshDim = Literal["pp", "dp", "dp_replicate", "dp_shard", "cp", "tp"]
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dimensions in their (row-major, torchtitan's) order: tp ranks are adjacent, pp
outermost (a pipeline stage's peers are the ranks of one block of the world)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """Sizes of the mesh dimensions, in row-major order (pp, dp_replicate, dp_shard, cp, tp).

    `pp`: pipeline stages (`pipeline_stages` cuts the model over them). `dp_replicate`:
    replicas (DDP, or HSDP's outer dimension, across nodes). `dp_shard`: ranks
    FSDP2 shards parameters over. `cp`: context parallelism (sequence split; CUDA only).
    `tp`: tensor parallelism (adjacent ranks, so a tp group stays on one node). One size may be
    -1: it is filled so the product equals the world size. `dp` is dp_replicate x dp_shard, the
    ranks that see different data.

    Example:
        >>> from accel import Parallelism
        >>> p = Parallelism(dp_shard=-1, tp=2).resolve(8)
        >>> p.dp_shard, p.dp_size
        (4, 4)
    """

    pp: int = 1
    """Pipeline-parallel ranks: the model is cut into stages over them (outermost dimension)."""
    dp_replicate: int = 1
    """Replicas of the (possibly sharded) model; gradients are all-reduced across them."""
    dp_shard: int = 1
    """Ranks FSDP2 shards parameters, gradients and optimizer state over."""
    cp: int = 1
    """Ranks a sequence is split over (context parallelism)."""
    tp: int = 1
    """Ranks each tensor-parallel layer is split over."""

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1 or value == 0:
                raise ValueError(
                    f"Parallelism: {name}={value!r} must be an int >= 1, or -1 to fill the "
                    "world size, e.g. Parallelism(dp_shard=-1, tp=2)."
                )
        filled = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if len(filled) > 1:
            raise ValueError(
                f"Parallelism: {' and '.join(f'{n}=-1' for n in filled)}; at most one size may "
                "be -1 (filled from the world size). Give the others explicitly."
            )

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    def resolve(self, world_size: int) -> Parallelism:
        """Return these sizes with the -1 filled for `world_size`; raise if they cannot match.

        Example:
            >>> Parallelism(tp=-1).resolve(4).tp
            4
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise TypeError(
                f"Parallelism.resolve: world_size={world_size!r} must be an int >= 1, the number "
                "of processes. Pass ctx.world_size, e.g. Parallelism(tp=-1).resolve(4)."
            )
        known = 1
        for size in self.sizes:
            known *= size if size != -1 else 1
        filled = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if filled and world_size % known == 0:
            fill = {filled[0]: world_size // known}
            return Parallelism(**{n: fill.get(n, getattr(self, n)) for n in MESH_DIMS})
        if filled or known != world_size:
            shown = " x ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS)
            raise ValueError(
                f"Parallelism: {shown} does not multiply to world_size={world_size}; the sizes "
                f"must multiply to the number of processes. Change a size, or set one to -1 "
                "to fill, e.g. Parallelism(dp_shard=-1, tp=2)."
            )
        return self

    def names(self) -> tuple[str, ...]:
        """The dimensions of size > 1, in mesh order: the dimensions the DeviceMesh has."""
        return tuple(n for n in MESH_DIMS if getattr(self, n) > 1)
