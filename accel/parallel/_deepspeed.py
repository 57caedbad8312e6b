"""Build the DeepSpeed engine for wrap_model, and its C++ op ahead of it, one build at a time.

Imported only when a DeepSpeed strategy is asked for: it imports deepspeed.
"""

from __future__ import annotations

import fcntl
import time
import weakref
from pathlib import Path
from typing import Any

from torch import nn

from accel.context import RunContext
from accel.parallel._deepspeed_config import engine_config, resolve_config
from accel.parallel.deepspeed import ENGINE_REF, DeepSpeedOptions

_OP = "ShareMemCommBuilder"  # DeepSpeed's CPU shared-memory comm op, built at engine start


def _import() -> Any:
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(
            "wrap_model: strategy='deepspeed' needs DeepSpeed: pip install "
            "'accel-train[deepspeed]'."
        ) from err
    return deepspeed


def build_ops(*, remove_stale_lock: bool) -> float:
    """Build DeepSpeed's CPU comm op under a file lock; see `build_deepspeed_ops`."""
    _import()
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    start = time.perf_counter()
    builder = get_accelerator().create_op_builder(_OP)
    if builder is None or not builder.is_compatible(verbose=False):
        return time.perf_counter() - start  # not a CPU run: nothing is built at start
    folder = Path(_get_build_directory(builder.NAME, verbose=False))
    guard = folder.parent / f"{folder.name}.accel-build.lock"
    with open(guard, "a") as handle:  # accel's own lock: released by the kernel if killed
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"  # torch's FileBaton; every accel build holds the guard
            if stale.exists():
                if not remove_stale_lock:
                    raise RuntimeError(
                        f"wrap_model: {stale} is left from a killed DeepSpeed op build, and "
                        "every build would wait on it forever. Remove it (rm "
                        f"{stale}, or make deepspeed-ops), then run again."
                    )
                stale.unlink()
            builder.load(verbose=False)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return time.perf_counter() - start


def apply_deepspeed(ctx: RunContext, model: nn.Module, options: DeepSpeedOptions) -> nn.Module:
    """deepspeed.initialize over the running process group; return the engine."""
    deepspeed = _import()
    config, init_flag = resolve_config(
        ctx,
        model,
        options.config if options.config is not None else dict(ctx.deepspeed or ()),
        micro_batch_size=options.micro_batch_size,
        client_opt=options.optimizer is not None,
    )
    if init_flag:
        raise NotImplementedError(
            "wrap_model: zero3_init_flag=True builds the model inside deepspeed.zero.Init, and "
            "wrap_model receives a model built already. Build it yourself under "
            "`with deepspeed.zero.Init(config_dict_or_path=...)`, and set zero3_init_flag: false."
        )
    if options.optimizer is None and "optimizer" not in config:
        raise ValueError(
            "wrap_model: DeepSpeedOptions(optimizer=None) and the DeepSpeed config has no "
            "'optimizer' section; pass optimizer=torch.optim.AdamW(model.parameters(), ...)."
        )
    if options.optimizer is not None and "optimizer" in config:
        raise ValueError(
            "wrap_model: an optimizer was given in DeepSpeedOptions and in the DeepSpeed config's "
            "'optimizer' section; keep one of them."
        )
    if ctx.world_size > 1 and not _dist_ready():
        raise RuntimeError(
            "wrap_model: strategy='deepspeed' runs over the process group; call "
            "accel.init_distributed() first."
        )
    if ctx.device.type == "cpu":
        build_ops(remove_stale_lock=False)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=options.optimizer,
        config=engine_config(config, ctx.world_size),
        dist_init_required=False,
    )
    ref = weakref.ref(engine)
    for opt in {id(o): o for o in (options.optimizer, optimizer, engine.optimizer) if o}.values():
        setattr(opt, ENGINE_REF, ref)  # optimizer_step(ctx, opt) finds the engine through it
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is not None:
        setattr(inner, ENGINE_REF, ref)
    return engine  # type: ignore[no-any-return]


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
