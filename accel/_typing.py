"""Type aliases shared across accel, declared once."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import torch

Precision: TypeAlias = Literal["fp32", "bf16", "fp16"]
"""Mixed-precision mode: fp32 weights always; bf16/fp16 name the autocast compute dtype."""

COMPUTE_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})
"""The compute dtype of each mixed precision (fp32 has none: nothing is cast)."""

Backend: TypeAlias = Literal["gloo", "nccl", "mpi"]
"""A torch.distributed backend accel knows how to pick devices for."""

ReduceOp: TypeAlias = Literal["sum", "mean", "max", "min"]

TensorTree: TypeAlias = Any
"""A tensor, or a tuple/list/dict nesting of them (what the collectives accept)."""
