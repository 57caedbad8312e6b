"""Type aliases shared across accel, declared once."""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

Precision: TypeAlias = Literal["fp32", "bf16", "fp16"]
"""Mixed-precision mode: fp32 weights always; bf16/fp16 name the autocast compute dtype."""

Backend: TypeAlias = Literal["gloo", "nccl", "mpi"]
"""A torch.distributed backend accel knows how to pick devices for."""

ReduceOp: TypeAlias = Literal["sum", "mean", "max", "min"]

TensorTree: TypeAlias = Any
"""A tensor, or a tuple/list/dict nesting of them (what the collectives accept)."""
