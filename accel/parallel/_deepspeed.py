"""Build the DeepSpeed engine for wrap_model from the resolved config and the user's optimizer.

Imported only when a DeepSpeed strategy is asked for: it imports deepspeed.
"""

from __future__ import annotations

import weakref

from torch import nn

from accel._deepspeed_flags import ENGINE_REF
from accel.context import RunContext
from accel.parallel._deepspeed_config import engine_config, resolve_config
from accel.parallel._deepspeed_ops import build_ops, import_deepspeed
from accel.parallel._deepspeed_padding import clear_zero3_padding
from accel.parallel.deepspeed import DeepSpeedOptions


def apply_deepspeed(ctx: RunContext, model: nn.Module, options: DeepSpeedOptions) -> nn.Module:
    """deepspeed.initialize over the running process group; return the engine."""
    deepspeed = import_deepspeed()
    config, init_flag = resolve_config(
        ctx,
        model,
        options.config,  # wrap_model's plan filled in the launcher's when none was given
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
    clear_zero3_padding(engine)  # DeepSpeed leaves it unwritten: the same run, the same bytes
    ref = weakref.ref(engine)
    for opt in {id(o): o for o in (options.optimizer, optimizer, engine.optimizer) if o}.values():
        setattr(opt, ENGINE_REF, ref)  # optimizer_step(ctx, opt) finds the engine through it
    # The module itself leads there too: under ZeRO-3 its parameters are empty partitions, so
    # save_model or save_state of `unwrap_model(engine)` must go through the engine.
    model.__dict__[ENGINE_REF] = ref
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is not None:
        setattr(inner, ENGINE_REF, ref)
    return engine  # type: ignore[no-any-return]


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
