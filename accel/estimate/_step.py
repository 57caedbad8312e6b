"""One rank's training steps under a `MemoryAccount`: build, wrap, forward, backward, step.

The same function runs in the fake world (the estimate) and in a real one (the measurement the
estimate is checked against): it builds the model, wraps it with `wrap_model` as the run's
context says, makes the optimizer and its state, and runs a training step, each phase counted
under its own category.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel.context import RunContext
from accel.estimate._account import CATEGORIES, MemoryAccount, watching_resizes
from accel.estimate._fake import in_fake_world
from accel.parallel import wrap_model
from accel.parallel.deepspeed import DeepSpeedOptions
from accel.precision import autocast, optimizer_step, scaled_backward

OptimizerSpec = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSpec:
    """What one rank runs: the model's constructor, its batch, optimizer and loss."""

    build: Callable[[], nn.Module]
    """Builds the whole model (called inside the account, on fake or real tensors)."""
    batch: tuple[int, ...] | Callable[[], Any]
    """One rank's batch: the shape of token ids, or a callable returning the batch."""
    optimizer: OptimizerSpec = "adamw"
    """"adamw", "adam", "sgd" (plain, no state) or a callable making one from parameters."""
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    """loss(output, batch); None: the model's own (`.loss`) or token cross entropy."""
    tp_plan: Any = None
    """wrap_model's tp_plan (None: "auto" when tensor parallel)."""
    device_type: str = "cpu"
    """The device type the run trains on: a named optimizer runs as torch runs it there
    (foreach on CUDA, whose temporaries are a parameter-sized list; one tensor at a time on
    the CPU)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Bytes one rank holds at its peak, by category."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    peak: int
    """The sum of the above at the moment the total was highest."""
    peak_phase: str
    """Where the peak fell: "forward", "backward" or "optimizer"."""
    setup: int
    """Bytes held once the model is wrapped and before the first step (weights and buffers)."""


def check_optimizer_spec(value: Any) -> None:
    if callable(value) or value in _OPTIMIZERS:
        return
    raise ValueError(
        f"estimate_memory: optimizer={value!r} is not one of {_OPTIMIZERS} or a callable "
        "taking the parameters; pass optimizer='adamw', or lambda params: MyOptimizer(params)."
    )


def make_optimizer(
    spec: OptimizerSpec, params: list[nn.Parameter], device_type: str
) -> torch.optim.Optimizer:
    if callable(spec):
        return spec(params)
    foreach = device_type == "cuda"  # torch's default there; the fake tensors sit on the CPU
    if spec == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    cls = torch.optim.AdamW if spec == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-3, foreach=foreach)


def make_batch(spec: tuple[int, ...] | Callable[[], Any], model: nn.Module, device: Any) -> Any:
    """The batch: token ids of the given shape (in the model's embedding's range), or the
    callable's value."""
    if callable(spec):
        return spec()
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"estimate_memory: batch={spec!r} is the shape of token ids, and "
            f"{type(model).__name__} has no nn.Embedding to draw them from; pass a callable "
            "that returns the batch (the CLI: --batch module:callable)."
        )
    return torch.randint(0, embedding.num_embeddings, tuple(spec), device=device)


def _takes_labels(model: nn.Module) -> bool:
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in names and "input_ids" in names


def forward_loss(model: nn.Module, batch: Any, loss: Callable[[Any, Any], Any] | None) -> Any:
    """The loss of one forward: `loss(output, batch)`, the model's own, or token cross entropy."""
    inner = getattr(model, "module", model)  # DDP and DeepSpeed's engine forward to .module
    if isinstance(batch, torch.Tensor) and loss is None and _takes_labels(inner):
        return model(input_ids=batch, labels=batch).loss  # a Hugging Face model scores itself
    if isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(*batch) if isinstance(batch, tuple) else model(batch)
    if loss is not None:
        return loss(out, batch)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = getattr(out, "logits", out)
    if (
        isinstance(logits, torch.Tensor)
        and isinstance(batch, torch.Tensor)
        and not batch.is_floating_point()
        and tuple(logits.shape[:-1]) == tuple(batch.shape)
    ):
        return F.cross_entropy(logits.flatten(0, -2), batch.flatten())
    if isinstance(logits, torch.Tensor):
        return logits.mean()
    raise ValueError(
        f"estimate_memory: the model returned a {type(out).__name__}, with no tensor or .loss "
        "to train on; pass loss=lambda output, batch: ... (the CLI: --loss module:callable)."
    )


def _breakdown(account: MemoryAccount, setup: int) -> Usage:
    peak = account.peak
    return Usage(**{c: peak[c] for c in CATEGORIES}, peak=account.peak_total,
                 peak_phase=account.peak_phase, setup=setup)  # fmt: skip


def run_steps(ctx: RunContext, spec: StepSpec, *, round_to: int = 1) -> Usage:
    """Build and wrap `spec`'s model, give the optimizer its state, then run one training step,
    all under an account; the usage at the step's peak.

    The optimizer's state is made by stepping it once over gradients of zeros (what the first
    real step allocates, at a fraction of its cost), so the measured step runs as every later
    step of a run does. A DeepSpeed engine, whose optimizer is its own, runs two real steps.
    """
    account = MemoryAccount(round_to=round_to)
    with account, watching_resizes(account):
        wrapped, optimizer, deepspeed = _wrapped(ctx, spec)
        account.set_aside([*wrapped.parameters(), *wrapped.buffers()])
        for p in wrapped.parameters():
            if p.requires_grad:  # a gradient is named as soon as it is accumulated
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda q: account.track([q.grad], "gradients")
                )
        if not deepspeed:
            with account.phase_of("optimizer"):
                _prime(wrapped, optimizer)
        setup = account.total
        account.peak, account.peak_phase = dict(account.now), "setup"
        with account.phase_of("forward"):
            batch = make_batch(spec.batch, wrapped, ctx.device)
        for _ in range(2 if deepspeed else 1):
            with account.phase_of("forward"), autocast(ctx):
                loss = forward_loss(wrapped, batch, spec.loss)
            _backward_and_step(ctx, account, wrapped, optimizer, loss)
            del loss
    return _breakdown(account, setup)


def _wrapped(ctx: RunContext, spec: StepSpec) -> tuple[nn.Module, Any, bool]:
    """(the wrapped model, its optimizer, whether it is a DeepSpeed engine)."""
    model = spec.build()
    if ctx.wrap.deepspeed is not None:
        optimizer = make_optimizer(spec.optimizer, list(model.parameters()), spec.device_type)
        options = DeepSpeedOptions(optimizer=optimizer, micro_batch_size=_rows(spec.batch))
        return wrap_model(ctx, model, strategy="deepspeed", deepspeed=options), optimizer, True
    tp = ctx.parallelism is not None and ctx.parallelism.tp > 1
    plan = (spec.tp_plan if spec.tp_plan is not None else "auto") if tp else None
    wrapped = wrap_model(ctx, model, tp_plan=plan)  # type: ignore[arg-type]
    _quiet_ddp(wrapped)
    return (
        wrapped,
        make_optimizer(spec.optimizer, list(wrapped.parameters()), spec.device_type),
        False,
    )


def _prime(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Step the optimizer over gradients of zeros: its state exists, nothing else is left."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _backward_and_step(
    ctx: RunContext, account: MemoryAccount, model: nn.Module, optimizer: Any, loss: Any
) -> None:
    with account.phase_of("backward"):
        scaled_backward(ctx, loss)
    account.track(_grads(model), "gradients")
    with account.phase_of("optimizer"):
        optimizer_step(ctx, optimizer)
        _zero_grad(model, optimizer)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


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
