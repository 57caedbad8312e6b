"""One rank's training steps under a `MemoryAccount`: build, wrap, forward, backward, step.

The same function runs in the fake world (the estimate) and in a real one (the measurement the
estimate is checked against): it builds the model, wraps it with `wrap_model` as the run's
context says, makes the optimizer and its state, and runs a training step, each phase counted
under its own category.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from accel.context import RunContext
from accel.estimate._account import CATEGORIES, MemoryAccount, watching_resizes
from accel.estimate._fake import in_fake_world
from accel.estimate._pipeline import pipeline_trainer
from accel.estimate._spec import (
    StepSpec,
    Trainer,
    Usage,
    forward_loss,
    make_batch,
    make_optimizer,
    token_range,
)
from accel.parallel import wrap_model
from accel.parallel.deepspeed import DeepSpeedOptions
from accel.precision import autocast, optimizer_step, scaled_backward


def _breakdown(account: MemoryAccount, setup: int, role: str) -> Usage:
    peak = account.peak
    return Usage(role=role, **{c: peak[c] for c in CATEGORIES}, peak=account.peak_total,
                 host=account.host_peak, peak_phase=account.peak_phase,
                 setup=setup)  # fmt: skip


def run_steps(ctx: RunContext, spec: StepSpec, *, round_to: int = 1) -> Usage:
    """Build and wrap `spec`'s model, give the optimizer its state, then run one training step,
    all under an account; the usage at the step's peak.

    The optimizer's state is made by stepping it once over gradients of zeros (what the first
    real step allocates, at a fraction of its cost), so the measured step runs as every later
    step of a run does. A DeepSpeed engine, whose optimizer is its own, runs two real steps.
    """
    ctx, host = _offloaded(ctx)
    if host:  # the optimizer steps on the host: as torch runs it on a CPU
        spec = replace(spec, device_type="cpu")
    account = MemoryAccount(round_to=round_to, host=host)
    with account, watching_resizes(account):
        trainer = (pipeline_trainer if ctx.pp_size > 1 else _trainer)(ctx, spec)
        if trainer.engine:
            account.host = _deepspeed_offload(account, trainer.modules[0])
        params = [p for m in trainer.modules for p in m.parameters()]
        account.set_aside([*params, *(b for m in trainer.modules for b in m.buffers())])
        for p in params:
            if p.requires_grad:  # a gradient is named as soon as it is accumulated
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda q: account.track([q.grad], "gradients")
                )
        if not trainer.engine:
            with account.phase_of("optimizer"):
                _prime(params, trainer.optimizer)
        setup = account.total
        account.restart_peak("setup")
        with account.phase_of("forward"):
            batch = trainer.make_batch()
        for _ in range(2 if trainer.engine else 1):
            trainer.forward_backward(account, batch)
            account.track([p.grad for p in params if p.grad is not None], "gradients")
            with account.phase_of("optimizer"):
                optimizer_step(ctx, trainer.optimizer)
                _zero_grad(trainer.modules[0], trainer.optimizer)
    return _breakdown(account, setup, trainer.role)


def _offloaded(ctx: RunContext) -> tuple[RunContext, frozenset[str]]:
    """The context the step runs under, and the categories CPU offload holds in host memory.

    FSDP2's offload_params keeps the sharded weights, their gradients and the optimizer (its
    state and its step) in host memory, and gathers and reduce-scatters on the device, as
    without offload. torch's offload path needs a CUDA device, so the step runs FSDP2 without
    it and counts those categories as host memory.
    """
    fsdp = ctx.wrap.fsdp
    if fsdp is None or not fsdp.offload_params or ctx.wrap.deepspeed is not None:
        return ctx, frozenset()
    wrap = replace(ctx.wrap, fsdp=replace(fsdp, offload_params=False))
    return replace(ctx, wrap=wrap), frozenset({"parameters", "gradients", "optimizer_state"})


def _deepspeed_offload(account: MemoryAccount, engine: Any) -> frozenset[str]:
    """The categories a DeepSpeed engine's offload holds in host memory, its host tensors
    named as such: the optimizer's fp32 master partitions and their gradient buffers count as
    optimizer state (ZeRO's own term), and under ZeRO-3's parameter offload, the partitions of
    the weights as parameters."""
    host = set()
    if engine.zero_offload_optimizer():
        inner = engine.optimizer.optimizer
        masters = [p for group in inner.param_groups for p in group["params"]]
        account.track([*masters, *(p.grad for p in masters)], "optimizer_state")
        host.add("optimizer_state")
    if engine.zero_offload_param():
        account.track([p.ds_tensor for p in engine.module.parameters()], "parameters")
        host.add("parameters")
    return frozenset(host)


def _trainer(ctx: RunContext, spec: StepSpec) -> Trainer:
    """The whole model wrapped by `wrap_model` (or a DeepSpeed engine), one forward a step."""
    model = spec.build()
    high = token_range(spec.batch, model)
    if ctx.wrap.deepspeed is not None:
        optimizer = make_optimizer(spec.optimizer, list(model.parameters()), spec.device_type)
        options = DeepSpeedOptions(optimizer=optimizer, micro_batch_size=_rows(spec.batch))
        if in_fake_world():
            _stay_put(model)
        wrapped = wrap_model(ctx, model, strategy="deepspeed", deepspeed=options)
    else:
        tp = ctx.parallelism is not None and ctx.parallelism.tp > 1
        plan = (spec.tp_plan if spec.tp_plan is not None else "auto") if tp else None
        wrapped = wrap_model(ctx, model, tp_plan=plan)  # type: ignore[arg-type]
        _quiet_ddp(wrapped)
        optimizer = make_optimizer(spec.optimizer, list(wrapped.parameters()), spec.device_type)

    def forward_backward(account: MemoryAccount, batch: Any) -> None:
        with account.phase_of("forward"), autocast(ctx):
            loss = forward_loss(wrapped, batch, spec.loss)
        with account.phase_of("backward"):
            scaled_backward(ctx, loss)

    return Trainer(
        role="every rank",
        modules=(wrapped,),
        optimizer=optimizer,
        engine=ctx.wrap.deepspeed is not None,
        make_batch=lambda: make_batch(spec.batch, high, ctx.device),
        forward_backward=forward_backward,
    )


def _stay_put(model: nn.Module) -> None:
    """Make `model.to(...)` a no-op: DeepSpeed's engine moves the model to its device, which in
    the fake world it is on already, and torch cannot move fake parameters in place (it swaps
    them, and the fake mode holds weak references to every fake tensor)."""
    model.to = lambda *args, **kwargs: model  # type: ignore[method-assign]


def _prime(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Step the optimizer over gradients of zeros: its state exists, nothing else is left."""
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _zero_grad(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    engine_zero = getattr(model, "zero_grad", None)
    optimizer.zero_grad(set_to_none=True)
    if engine_zero is not None:
        engine_zero()


def _rows(batch: Any) -> int | None:
    return int(batch[0]) if isinstance(batch, tuple) and batch else None


def _quiet_ddp(model: nn.Module) -> None:
    """In the fake world, DDP's reducer needs each all-reduce's result: give it the bucket."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or not in_fake_world():
        return

    def allreduce_in_place(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        torch.distributed.all_reduce(buffer.div_(model.process_group.size()), group=group)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks the hook's annotations as objects; this module's are strings (__future__).
    bucket_type = torch.distributed.GradBucket  # type: ignore[attr-defined]
    allreduce_in_place.__annotations__.update(
        bucket=bucket_type, **{"return": torch.futures.Future[torch.Tensor]}
    )
    model.register_comm_hook(model.process_group, allreduce_in_place)
