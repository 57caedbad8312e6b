"""Type aliases shared across accel, declared once."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import torch

from accel_settings.values import Precision as Precision  # declared with its parser

COMPUTE_DTYPES = MappingProxyType(
    {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
)
"""The autocast (and FSDP2 gather) dtype of each mixed precision (fp32 has none: nothing is
cast; fp8's float8 matmuls happen inside torchao's Float8Linear, bf16 everywhere else)."""

Backend: TypeAlias = Literal["gloo", "nccl", "mpi"]
"""A torch.distributed backend accel knows how to pick devices for."""

ReduceOp: TypeAlias = Literal["sum", "mean", "max", "min"]

TensorTree: TypeAlias = Any
"""A tensor, or a tuple/list/dict nesting of them (what the collectives accept)."""

_SHORT_DTYPES = MappingProxyType(
    {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
)
"""accel's precision names, accepted wherever a dtype is (Accelerate's spellings)."""


def as_dtype(fn: str, name: str, value: Any, *, floating: bool = True) -> torch.dtype | None:
    """Parse a dtype argument: a `torch.dtype`, its name ("bfloat16", "torch.bfloat16") or a
    precision name ("bf16", "fp16", "fp32"); None stays None.

    The one parser of every public argument that takes a dtype. With `floating` (the default)
    the dtype must be a floating-point one (a dtype weights or gradients are cast to).

    Raises:
        TypeError: `value` is neither a dtype nor a string.
        ValueError: a string naming no dtype, or a non-floating dtype where one is required.
    """
    if value is None:
        return None
    allowed = '"bf16", "bfloat16", "torch.bfloat16" or torch.bfloat16'
    kind = "floating dtype" if floating else "dtype"
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(
            f"{fn}: {name}={value!r} is not a {kind}; expected a torch.dtype or its name, "
            f"e.g. {allowed}."
        )
    dtype = value
    if isinstance(value, str):
        text = value.removeprefix("torch.")
        found = _SHORT_DTYPES.get(text, getattr(torch, text, None))
        if not isinstance(found, torch.dtype):
            raise ValueError(
                f"{fn}: {name}={value!r} names no torch dtype; expected a torch.dtype or its "
                f"name, e.g. {allowed} (also float16/fp16, float32/fp32)."
            )
        dtype = found
    assert isinstance(dtype, torch.dtype)
    if floating and not dtype.is_floating_point:
        raise ValueError(
            f"{fn}: {name}={value!r} is not a floating dtype; expected one such as "
            f"{allowed}, or float16/fp16, float32/fp32."
        )
    return dtype
