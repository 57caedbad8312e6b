"""`accel estimate-memory module:callable`: model size per dtype, built on the meta device."""

from __future__ import annotations

import argparse
import importlib

import torch

# Bytes per element of each reported dtype (int4 packs two values a byte).
_DTYPES: tuple[tuple[str, float], ...] = (
    ("float32", 4), ("float16/bfloat16", 2), ("int8", 1), ("int4", 0.5)
)  # fmt: skip


def _load(spec: str) -> torch.nn.Module:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model={spec!r} must look like 'package.module:callable'.")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model={spec!r} cannot be loaded: {err}") from None
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={spec!r} returned a {type(model).__name__}, not an nn.Module.")
    return model


def count_elements(model: torch.nn.Module) -> tuple[int, int, str]:
    """Return (elements in total, elements of the largest layer, that layer's name).

    Shared (tied) parameters count once; a layer is a module with its own parameters or buffers.
    """
    total = sum(t.numel() for t in model.parameters()) + sum(b.numel() for b in model.buffers())
    largest, name = 0, ""
    for module_name, module in model.named_modules():
        own = sum(t.numel() for t in module.parameters(recurse=False))
        own += sum(b.numel() for b in module.buffers(recurse=False))
        if own > largest:
            largest, name = own, module_name or "(root)"
    return total, largest, name


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def run(args: argparse.Namespace) -> int:
    model = _load(args.model)
    total, largest, name = count_elements(model)
    print(f"Memory for {args.model}: {total:,} elements; largest layer {name!r} ({largest:,})\n")
    print("| dtype | largest layer | total size | training with Adam |")
    print("|---|---|---|---|")
    for dtype, per in _DTYPES:
        sizes = (_size(largest * per), _size(total * per), _size(4 * total * per))
        print(f"| {dtype} | {' | '.join(sizes)} |")
    return 0
