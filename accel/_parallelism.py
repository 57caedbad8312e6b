"""Value types of N-D parallelism: the mesh sizes (`Parallelism`) and how FSDP2 is applied.

They live below `RunContext`, which records both, and below `wrap_model`, which applies them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from accel._typing import as_dtype

__all__ = ["FSDPOptions", "Parallelism"]

MeshDim = Literal["pp", "dp", "dp_replicate", "dp_shard", "cp", "tp"]
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dimensions in their (row-major, torchtitan's) order: tp ranks are adjacent, pp
outermost (a pipeline stage's peers are the ranks of one block of the world)."""

CompileMode = Literal[False, True, "regional"]


def check_compile(fn: str, value: Any, *, name: str = "compile") -> CompileMode:
    """The one validator of a compile setting: False, True or "regional" (not 0, 1 or "yes")."""
    if value is False or value is True or value == "regional":
        return cast(CompileMode, value)
    raise ValueError(
        f"{fn}: {name}={value!r} must be False, True or 'regional'; False does not compile, "
        "True compiles the whole model, 'regional' each repeated block. Use compile=True."
    )


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


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPOptions:
    """How `wrap_model` applies FSDP2 (`fully_shard`).

    Dtypes take a `torch.dtype` or its name ("bf16", "bfloat16", "torch.bfloat16"). Activation
    checkpointing is `wrap_model(..., activation_checkpointing=...)`, for every strategy; the
    field here still works but is deprecated.

    Example:
        >>> from accel import FSDPOptions
        >>> FSDPOptions(layer_classes=("Block",), param_dtype="bf16").param_dtype
        torch.bfloat16
    """

    layer_classes: tuple[type[nn.Module] | str, ...] = ()
    """Every submodule of these classes (or class names, as Accelerate's
    `fsdp_transformer_layer_cls_to_wrap` gives them) is its own FSDP2 unit, sharded before the
    root; they are also the units of activation checkpointing and regional compile."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (less memory, one more all-gather in backward)."""
    param_dtype: torch.dtype | None = None
    """Dtype parameters are gathered and computed in. None: bf16 when ctx.precision is bf16
    (or fp16 for fp16), else the parameters' own dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in. None: float32 whenever param_dtype is lower."""
    activation_checkpointing: bool = False
    """Deprecated: use `wrap_model(..., activation_checkpointing=True)`, which works under every
    strategy (True here still recomputes each layer-class block, with a DeprecationWarning)."""
    offload_params: bool = False
    """Keep sharded parameters and gradients on the CPU (FSDP2's CPUOffloadPolicy)."""
    sync_module_states: bool = False
    """Broadcast rank 0's parameters and buffers before sharding (different inits agree)."""

    def __post_init__(self) -> None:
        bad = [
            c
            for c in self.layer_classes
            if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))
        ]
        if bad or not isinstance(self.layer_classes, tuple):
            raise ValueError(
                f"FSDPOptions: layer_classes contains {bad or self.layer_classes!r}; pass a "
                "tuple of nn.Module subclasses or class names, e.g. layer_classes=(Block,)."
            )
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, as_dtype("FSDPOptions", name, getattr(self, name)))
        for name in (
            "reshard_after_forward", "activation_checkpointing", "offload_params",
            "sync_module_states",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"FSDPOptions: {name}={value!r} must be True or False. Use {name}=True."
                )
        if self.activation_checkpointing:
            warnings.warn(
                "FSDPOptions: activation_checkpointing=True is deprecated; pass "
                "wrap_model(ctx, model, activation_checkpointing=True) instead (it works under "
                "every strategy, DDP, tensor parallel and one process included).",
                DeprecationWarning,
                stacklevel=3,
            )
