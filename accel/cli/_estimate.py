"""`accel estimate-memory module:callable`: model size per dtype, built on the meta device."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

# Bytes per element of each reported dtype (int4 packs two values a byte).
_DTYPES: tuple[tuple[str, float], ...] = (
    ("float32", 4), ("float16/bfloat16", 2), ("int8", 1), ("int4", 0.5)
)  # fmt: skip


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _load(spec: str) -> tuple[torch.nn.Module, str]:
    """The model `spec` names, built on the meta device, and what built it."""
    if spec.endswith(".json") or Path(spec).is_dir():
        return _from_hf_config(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"model={spec!r} must look like 'package.module:callable', or be a Hugging Face "
            "config.json (or its folder)."
        )
    if os.getcwd() not in sys.path:  # `python -m` puts the current folder first; so does this
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # the user's module: any error while importing it is reported
        raise ValueError(f"model={spec!r} cannot be loaded: {_first_line(err)}") from err
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:  # the user's callable: reported in one line, not a traceback
        raise ValueError(
            f"model={spec!r} could not be built: {module_name}.{attr}() raised {_first_line(err)}"
        ) from err
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={spec!r} returned a {type(model).__name__}, not an nn.Module.")
    return model, ""


def _from_hf_config(spec: str) -> tuple[torch.nn.Module, str]:
    """The model class a Hugging Face config names (its first `architectures` entry, else
    `AutoModel`), built from the config alone on the meta device."""
    file = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not file.is_file():
        raise FileNotFoundError(f"model={spec!r}: {str(file)!r} does not exist.")
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"model={spec!r} is a Hugging Face config; building a model from it needs "
            "transformers. Install it: pip install transformers."
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(file))
        names = getattr(config, "architectures", None) or []
        build = getattr(transformers, names[0], None) if names else None
        with torch.device("meta"):
            model = (build or transformers.AutoModel.from_config)(config)
    except Exception as err:  # transformers' own errors, for a config it cannot read
        raise ValueError(f"model={spec!r} could not be built: {_first_line(err)}") from err
    return model, type(model).__name__


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
    model, built = _load(args.model)
    total, largest, name = count_elements(model)
    what = f"{args.model} ({built})" if built else args.model
    print(f"Memory for {what}: {total:,} elements; largest layer {name!r} ({largest:,})\n")
    print("| dtype | largest layer | total size | training with Adam |")
    print("|---|---|---|---|")
    for dtype, per in _DTYPES:
        sizes = (_size(largest * per), _size(total * per), _size(4 * total * per))
        print(f"| {dtype} | {' | '.join(sizes)} |")
    return 0
