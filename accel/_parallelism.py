"""The mesh sizes of N-D parallelism (`Parallelism`).

They live below `RunContext`, which records them, and below `wrap_model`, which applies them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Parallelism"]

MeshDim = Literal["pp", "dp", "dp_replicate", "dp_shard", "ep", "cp", "sp", "tp"]
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "sp", "tp")
"""The mesh dimensions in their (row-major, torchtitan's) order: tp ranks are adjacent, pp
outermost (a pipeline stage's peers are the ranks of one block of the world). sp sits inside cp
and outside tp (Accelerate's order: heads are split over tp first, then over sp); ep is the
innermost of the data dimensions (its all-to-all stays among near ranks), as torchtitan takes
its expert-parallel ranks from the inner part of dp_shard."""
DATA_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep")
"""The dimensions whose ranks see different data: `dp` is their product."""
SHARD_DIMS: tuple[str, ...] = ("dp_shard", "ep", "cp", "sp")
"""The dimensions FSDP2 shards the (non-expert) parameters over: every rank along them holds
the same replicated parameters (ep, cp and sp ranks compute on different tokens)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """Sizes of the mesh dimensions, in row-major order (pp, dp_replicate, dp_shard, ep, cp, sp,
    tp).

    `pp`: pipeline stages (`pipeline_stages` cuts the model over them). `dp_replicate`:
    replicas (DDP, or HSDP's outer dimension, across nodes). `dp_shard`: ranks
    FSDP2 shards parameters over. `ep`: expert parallelism (each rank holds num_experts / ep of
    every mixture-of-experts layer's experts and sees its own data). `cp`: context parallelism
    (sequence split, ring attention; CUDA only). `sp`: Ulysses sequence parallelism (sequence
    split, two all-to-alls around attention; any device). `tp`: tensor parallelism (adjacent
    ranks, so a tp group stays on one node). One size may be -1: it is filled so the product
    equals the world size. `dp` is dp_replicate x dp_shard x ep, the ranks that see different
    data.

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
    sp: int = 1
    """Ranks a sequence is split over by Ulysses sequence parallelism (all-to-all around
    attention: each rank attends over the whole sequence for heads / sp of the heads)."""
    ep: int = 1
    """Ranks the experts of each mixture-of-experts layer are split over (expert parallelism);
    they see different data, like dp_shard."""

    def _shown(self) -> tuple[str, ...]:
        # sp and ep are shown when used, so the sizes of a run without them read as before
        used = tuple(n for n in ("sp", "ep") if getattr(self, n) != 1)
        return ("pp", "dp_replicate", "dp_shard", "cp", "tp", *used)

    def __repr__(self) -> str:
        return f"Parallelism({', '.join(f'{n}={getattr(self, n)}' for n in self._shown())})"

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
    def sizes(self) -> tuple[int, ...]:
        """The sizes in mesh order: (pp, dp_replicate, dp_shard, ep, cp, sp, tp)."""
        return tuple(getattr(self, n) for n in MESH_DIMS)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: dp_replicate x dp_shard x ep."""
        return self.dp_replicate * self.dp_shard * self.ep

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
            shown = " x ".join(f"{n}={getattr(self, n)}" for n in self._shown())
            raise ValueError(
                f"Parallelism: {shown} does not multiply to world_size={world_size}; the sizes "
                f"must multiply to the number of processes. Change a size, or set one to -1 "
                "to fill, e.g. Parallelism(dp_shard=-1, tp=2)."
            )
        return self

    def names(self) -> tuple[str, ...]:
        """The dimensions of size > 1, in mesh order: the dimensions the DeviceMesh has."""
        return tuple(n for n in MESH_DIMS if getattr(self, n) > 1)


def _parts(p: Parallelism, name: str) -> tuple[str, ...] | None:
    """The root dimensions a flattened mesh dimension joins ("dp", "dp_shard_sp", ...)."""
    data = tuple(n for n in DATA_DIMS if getattr(p, n) > 1)
    shard = tuple(n for n in SHARD_DIMS if getattr(p, n) > 1)
    if name == "dp" and len(data) > 1:
        return data
    return shard if len(shard) > 1 and name == "_".join(shard) else None


def slice_mesh(mesh: Any, p: Parallelism, names: tuple[str, ...]) -> Any:
    """`mesh[names]`, a flattened dimension alone taken through `_flatten`, which returns the
    one `init_distributed` made (slicing it from the root is deprecated in torch 2.11+)."""
    parts = _parts(p, names[0]) if len(names) == 1 else None
    if parts is not None:
        return mesh[parts]._flatten(names[0])
    with warnings.catch_warnings():
        # HSDP over flattened shard dimensions: (dp_replicate, dp_shard_sp) has no other
        # spelling in torch 2.13 than this slice, which still works
        warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh")
        return mesh[names if len(names) > 1 else names[0]]
