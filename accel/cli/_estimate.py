"""`accel estimate-memory MODEL`: each rank's memory for a layout (with --batch), else the
model's size per dtype, built on the meta device.

The layout is read by `accel launch`'s own code (`resolve_config`: its flags, its config file,
the default config in force), so the estimate is of exactly the run `accel launch` would start.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from typing import Any

import torch

from accel._model_spec import first_line, model_factory

# Bytes per element of each reported dtype (int4 packs two values a byte).
_DTYPES: tuple[tuple[str, float], ...] = (
    ("float32", 4), ("float16/bfloat16", 2), ("int8", 1), ("int4", 0.5)
)  # fmt: skip


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


def _sizes(args: argparse.Namespace) -> int:
    build, built = model_factory(args.model)
    with torch.device("meta"):
        model = build()
    total, largest, name = count_elements(model)
    what = f"{args.model} ({built})" if built else args.model
    print(f"Memory for {what}: {total:,} elements; largest layer {name!r} ({largest:,})\n")
    print("| dtype | largest layer | total size | training with Adam |")
    print("|---|---|---|---|")
    for dtype, per in _DTYPES:
        sizes = (_size(largest * per), _size(total * per), _size(4 * total * per))
        print(f"| {dtype} | {' | '.join(sizes)} |")
    print("\nActivations and the layout are not counted; pass --batch (and accel launch's "
          "flags) for each rank's memory in training.")  # fmt: skip
    return 0


def _named(flag: str, spec: str) -> Any:
    """The object 'package.module:name' names (imported as `python -m` would)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--{flag}={spec!r} must look like 'package.module:name'.")
    model_factory(f"{module_name}:{attr}")  # puts the current folder on the path, as for model
    try:
        return getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # the user's module: reported in one line
        raise ValueError(f"--{flag}={spec!r} cannot be loaded: {first_line(err)}") from err


def _batch(spec: str) -> Any:
    if re.fullmatch(r"\d+(x\d+)*", spec):
        return tuple(int(n) for n in spec.split("x"))
    if ":" in spec:
        return _named("batch", spec)
    raise ValueError(
        f"--batch={spec!r} is neither a shape of token ids (e.g. 4x2048) nor "
        "'package.module:callable' returning the batch."
    )


def _count(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"--{flag}={value!r} is not a whole number; pass e.g. --{flag} 4.")
    return int(value)


def run(args: argparse.Namespace) -> int:
    if args.batch is None:
        return _sizes(args)
    # On use, as each command's module imports what it runs (accel.cli._main): without --batch
    # the command builds on meta and needs neither the launcher nor the fake world.
    from accel.cli._launch import resolve_config  # accel launch's own reading of the layout
    from accel.estimate import estimate_memory  # on use: see above

    optimizer = args.optimizer or "adamw"
    estimate = estimate_memory(
        args.model,
        _batch(args.batch),
        config=resolve_config(args),
        optimizer=_named("optimizer", optimizer) if ":" in optimizer else optimizer,
        loss=_named("loss", args.loss) if args.loss else None,
        tp_plan=_named("tp_plan", args.tp_plan) if args.tp_plan else None,
        microbatches=_count("microbatches", args.microbatches),
        schedule=args.pp_schedule or "1f1b",
        device=args.device,
    )
    if args.json:
        print(json.dumps(estimate.as_dict(), indent=2))
        return 0
    p = estimate.parallelism
    mesh = " x ".join(f"{n}={getattr(p, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp",
                                                        "tp"))  # fmt: skip
    print(
        f"Memory per rank for {args.model}, {estimate.world_size} processes ({mesh}), "
        f"{estimate.strategy}, {estimate.precision}, batch {args.batch} a rank, "
        f"{optimizer}, counted for {estimate.device}:\n"
    )
    print(estimate.table())
    if any(r.host for r in estimate.ranks):
        print("\nhost: what CPU offload holds in host memory at its peak (not in the device's "
              "columns or peak).")  # fmt: skip
    return 0
