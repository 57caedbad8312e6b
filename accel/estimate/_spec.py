"""What one rank's step runs: the spec (model, batch, optimizer, loss), and how each is made.

Shared by the step of a plain or data/tensor-parallel model (`_step`) and of a pipeline
stage (`_pipeline`), in the fake world (the estimate) and a real one (its measurement).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel.estimate._account import MemoryAccount

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
    microbatches: int | None = None
    """Under pipeline parallelism (pp > 1): microbatches a step splits the batch into (None:
    one per stage)."""
    schedule: str = "1f1b"
    """Under pipeline parallelism: the torch.distributed.pipelining schedule, by name."""
    device_type: str = "cpu"
    """The device type the run trains on: a named optimizer runs as torch runs it there
    (foreach on CUDA, whose temporaries are a parameter-sized list; one tensor at a time on
    the CPU)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Bytes one rank holds at its peak, by category."""

    role: str
    """What the rank holds: "every rank", or its pipeline stages ("pp stage 1 (last: the
    head)")."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    peak: int
    """The sum of the above at the moment the device's total was highest."""
    host: int
    """Host memory at its peak under CPU offload (0 without): the offloaded categories."""
    peak_phase: str
    """Where the peak fell: "forward", "backward" or "optimizer"."""
    setup: int
    """Bytes held once the model is wrapped and before the first step (weights and buffers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Trainer:
    """One rank's model made ready to train: what `run_steps` runs under the account."""

    role: str
    """What the rank holds (see `Usage.role`)."""

    modules: tuple[nn.Module, ...]
    """What the rank trains (the wrapped model, or its pipeline stages)."""
    optimizer: Any
    """The optimizer over their parameters (a DeepSpeed engine's, stepped through it)."""
    engine: bool
    """Whether the model is a DeepSpeed engine: it makes its optimizer's state itself, so two
    real steps run (the second measured) instead of priming the state."""
    make_batch: Callable[[], Any]
    """One rank's batch, made on the rank's device."""
    forward_backward: Callable[[MemoryAccount, Any], None]
    """Forward and backward of one batch, each counted in its phase."""


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


def token_range(spec: tuple[int, ...] | Callable[[], Any], model: nn.Module) -> int:
    """The range token ids are drawn from: the model's first nn.Embedding's size (0 when the
    batch is a callable's)."""
    if callable(spec):
        return 0
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"estimate_memory: batch={spec!r} is the shape of token ids, and "
            f"{type(model).__name__} has no nn.Embedding to draw them from; pass a callable "
            "that returns the batch (the CLI: --batch module:callable)."
        )
    return embedding.num_embeddings


def make_batch(spec: tuple[int, ...] | Callable[[], Any], high: int, device: Any) -> Any:
    """The batch: token ids of the given shape in [0, high), or the callable's value."""
    if callable(spec):
        return spec()
    return torch.randint(0, high, tuple(spec), device=device)


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
    return score(out, batch, loss)


def score(out: Any, batch: Any, loss: Callable[[Any, Any], Any] | None) -> Any:
    """The loss of a model's output: `loss(out, batch)`, the output's own `.loss`, token cross
    entropy of its logits against the batch's token ids, else the logits' mean."""
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
