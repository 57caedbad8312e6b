"""One rank's training steps under a `MemoryAccount`: build, wrap, forward, backward, step.

The same function runs in the fake world (the estimate) and in a real one (the measurement the
estimate is checked against): it builds the model, wraps it with `wrap_model` as the run's
context says, makes the optimizer, and runs two steps (the second with the optimizer state in
place, as every later step has it), each phase counted under its own category.
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

STEPS = 2
"""Steps run per rank: the first allocates the optimizer state, the second runs with it."""

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


def make_optimizer(spec: OptimizerSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if callable(spec):
        return spec(params)
    if spec == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    return (torch.optim.AdamW if spec == "adamw" else torch.optim.Adam)(params, lr=1e-3)


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
    """Build, wrap and train `spec`'s model for `STEPS` steps under an account; its usage."""
    from accel import optimizer_step, scaled_backward, wrap_model
    from accel.precision import autocast

    account = MemoryAccount(round_to=round_to)
    with account, watching_resizes(account):
        model = spec.build()
        strategy, options = _strategy(ctx, spec, model)
        tp_plan = spec.tp_plan if spec.tp_plan is not None else "auto"
        tp = ctx.parallelism is not None and ctx.parallelism.tp > 1 and strategy != "deepspeed"
        optimizer = None
        if strategy == "deepspeed":
            optimizer = make_optimizer(spec.optimizer, list(model.parameters()))
            options = options(optimizer)
            wrapped = wrap_model(ctx, model, strategy="deepspeed", deepspeed=options)
        else:
            plan = tp_plan if tp else None
            wrapped = wrap_model(ctx, model, tp_plan=plan)  # type: ignore[arg-type]
            optimizer = make_optimizer(spec.optimizer, list(wrapped.parameters()))
        del model
        _quiet_ddp(wrapped)
        for p in wrapped.parameters():
            if p.requires_grad:  # a gradient is named as soon as it is accumulated
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda q: account.track([q.grad], "gradients")
                )
        setup = account.total
        account.peak, account.peak_phase = dict(account.now), "setup"
        with account.phase_of("forward"):
            batch = make_batch(spec.batch, wrapped, ctx.device)
        for _ in range(STEPS):
            with account.phase_of("forward"), autocast(ctx):
                loss = forward_loss(wrapped, batch, spec.loss)
            with account.phase_of("backward"):
                scaled_backward(ctx, loss)
                del loss
            account.track(_grads(wrapped), "gradients")
            with account.phase_of("optimizer"):
                optimizer_step(ctx, optimizer)
                _zero_grad(wrapped, optimizer)
    return _breakdown(account, setup)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _zero_grad(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    engine_zero = getattr(model, "zero_grad", None)
    optimizer.zero_grad(set_to_none=True)
    if engine_zero is not None:
        engine_zero()


def _strategy(ctx: RunContext, spec: StepSpec, model: nn.Module) -> tuple[str, Any]:
    """ "deepspeed" (with a maker of its options) when the context asks for DeepSpeed."""
    if ctx.deepspeed is None:
        return "auto", None
    from accel.parallel.deepspeed import DeepSpeedOptions

    def options(optimizer: torch.optim.Optimizer) -> DeepSpeedOptions:
        return DeepSpeedOptions(optimizer=optimizer, micro_batch_size=_rows(spec.batch))

    return "deepspeed", options


def _rows(batch: Any) -> int | None:
    return int(batch[0]) if isinstance(batch, tuple) and batch else None


def _quiet_ddp(model: nn.Module) -> None:
    """In the fake world, DDP's reducer needs each all-reduce's result: give it the bucket."""
    from torch.nn.parallel import DistributedDataParallel

    from accel.estimate._fake import in_fake_world

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
