"""Plan before spending: what a layout costs each rank, from the real wrapping run on fake tensors.

`estimate_memory(model, batch, config=...)` plays one rank of each distinct role of the layout
(every pipeline stage; the other coordinates hold the same shapes) in a fake world of the
layout's size (torch's fake process group: one process, no data moved), builds the model on
fake tensors (shapes and dtypes, no memory), wraps it with the real `wrap_model`, gives the
optimizer its state and runs a real training step, counting every live tensor storage by what
it holds. docs/estimate.md says how it is made and how close it comes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accel._model_spec import model_factory
from accel._parallelism import Parallelism
from accel.config import Config
from accel.estimate import _child, _plan
from accel.estimate._spec import OptimizerSpec, StepSpec, Usage, check_optimizer_spec

__all__ = ["MemoryEstimate", "RankMemory", "estimate_memory"]

_CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to 512 bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One role's memory at its peak, in bytes (every rank of `ranks` holds the same)."""

    role: str
    """What these ranks hold: "every rank", "pp stage 1 (last: the head)", ..."""
    ranks: tuple[int, ...]
    """The global ranks in this role."""
    parameters: int
    """The rank's own weights and buffers (its shards under FSDP2 and tensor parallelism)."""
    gradients: int
    """Gradients of those weights held at the peak."""
    optimizer_state: int
    """The optimizer's state (and its step's temporaries, when the peak is in the step)."""
    activations: int
    """What forward saved for backward, backward's temporaries and the batch, at the peak."""
    communication: int
    """Collective buffers at the peak: FSDP2's gathered parameters and its all-gather and
    reduce-scatter buffers, DDP's buckets."""
    peak: int
    """The most the rank holds at once on its device: the sum of the above."""
    host: int
    """Host (CPU) memory at its peak under CPU offload: the offloaded weights, gradients and
    optimizer state (their bytes are not in the device's columns); 0 without offload."""
    peak_phase: str
    """Where the peak falls: "forward", "backward" or "optimizer"."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Per-rank memory of one layout (from `estimate_memory`)."""

    world_size: int
    """Processes in the layout."""
    parallelism: Parallelism
    """The mesh sizes, resolved to the world."""
    strategy: str
    """What wrap_model applies: "none", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "deepspeed"."""
    precision: str
    """The autocast precision of the steps."""
    device: str
    """The device type the bytes are counted for ("cuda": each rounded up to 512 bytes)."""
    ranks: tuple[RankMemory, ...]
    """One entry per distinct role, in rank order."""

    @property
    def peak(self) -> int:
        """The highest peak of any rank: what the largest device must hold."""
        return max(r.peak for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (bytes as ints; `accel estimate-memory --json` prints it)."""
        out = dataclasses.asdict(self)
        out["parallelism"] = dataclasses.asdict(self.parallelism)
        out["peak"] = self.peak
        return out

    def table(self) -> str:
        """A Markdown table: one row per role, sizes in GiB (a host column under offload)."""
        offload = any(r.host for r in self.ranks)
        head = ("role", "ranks", "parameters", "gradients", "optimizer state", "activations",
                "communication", "peak", *(("host (offloaded)",) if offload else ()))  # fmt: skip
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.ranks:
            sizes = (r.parameters, r.gradients, r.optimizer_state, r.activations,
                     r.communication)  # fmt: skip
            cells = [r.role, _ranks(r.ranks), *(gib(s) for s in sizes)]
            cells.append(f"**{gib(r.peak)}** ({r.peak_phase})")
            cells += [gib(r.host)] if offload else []
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def gib(n: int) -> str:
    """Bytes as GiB with two decimals (MiB below 0.1 GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 4:
        return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)})"
    return ", ".join(str(r) for r in ranks)


def estimate_memory(
    model: Callable[[], nn.Module] | str,
    batch: tuple[int, ...] | Callable[[], Any],
    *,
    config: Config | str | os.PathLike[str] | None = None,
    optimizer: OptimizerSpec = "adamw",
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    tp_plan: Any = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    device: str = "cuda",
) -> MemoryEstimate:
    """Estimate each rank's memory for one training step of a layout, on this CPU.

    Each distinct role of the layout (each pipeline stage; every other rank holds the same
    shapes as its stage's rank 0) is played in a fake world of the layout's size: the model is
    built on fake tensors, wrapped by `wrap_model` as `accel launch` would have it wrapped, its
    optimizer given its state (one step over zero gradients) and trained for one step
    (forward, backward, optimizer step), every live tensor counted by what it holds.

    Args:
        model: a callable returning the module (called inside the fake world), or what the
            command takes: "package.module:callable", or a Hugging Face config.json (or its
            folder; needs transformers, downloads nothing).
        batch: one rank's batch: the shape of token ids, e.g. (4, 2048) (drawn from the
            model's first nn.Embedding's range), or a callable returning the batch (a tensor,
            a tuple of positional arguments or a dict of keyword arguments).
        config: the layout, as `accel launch` reads it: an `accel.Config` (its
            `num_processes`, `parallelism_config`, `fsdp_config`, `deepspeed_config`,
            `mixed_precision`, ...) or a YAML file (accel's or Accelerate's); None is one
            process.
        optimizer: "adamw" (default), "adam", "sgd" (plain, no state), or a callable making
            the optimizer from the parameters.
        loss: `loss(output, batch) -> loss`; default: the model's own `.loss` (a Hugging Face
            model is given `labels=`), else cross entropy of the logits against the batch's
            token ids, else the output's mean.
        tp_plan: wrap_model's `tp_plan` under tensor parallelism; default "auto" (the Hugging
            Face model's own plan).
        microbatches: under pipeline parallelism (pp > 1), what `pipeline_stages` is given:
            the microbatches each step splits the batch into (default: one per stage).
        schedule: under pipeline parallelism, `pipeline_stages`' schedule ("1f1b", "gpipe",
            "interleaved_1f1b", "zbv", ...); the stages are cut evenly by repeated blocks.
        device: the device type the run will use: "cuda" rounds each tensor to the CUDA
            allocator's 512-byte blocks; "cpu" counts bytes as they are.

    Returns:
        A frozen `MemoryEstimate`: one `RankMemory` per distinct role, `peak` the highest.

    Raises:
        ValueError: for a layout that cannot work (mesh sizes that do not divide or fill the
            world, a setting refused), a model spec that cannot be loaded or built on fake
            tensors, a batch or loss the model cannot use, or a value the step reads from the
            data (a data-dependent shape or `.item()`), naming what to change.
        NotImplementedError: for a layout the estimate does not model yet (fp8).

    Example:
        >>> from torch import nn
        >>> import accel
        >>> est = accel.estimate_memory(
        ...     lambda: nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 100), nn.ReLU()),
        ...     (8, 16),
        ...     config=accel.Config(num_processes=2, distributed_type="FSDP"), device="cpu")
        >>> est.world_size, est.strategy, est.ranks[0].parameters < 4 * 100 * 64 * 2
        (2, 'fsdp2', True)
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(
            f"estimate_memory: device={device!r} is not 'cuda' or 'cpu'; pass the device type "
            "the run will train on."
        )
    check_optimizer_spec(optimizer)
    layout = _plan.layout(config)
    if layout.parallelism.pp > 1:
        _plan.check_microbatches(microbatches, batch)
    build, _ = model_factory(model) if isinstance(model, str) else (model, "")
    spec = StepSpec(build=build, batch=batch, optimizer=optimizer, loss=loss, tp_plan=tp_plan,
                    microbatches=microbatches, schedule=schedule,
                    device_type=device)  # fmt: skip
    round_to = _CUDA_BLOCK if device == "cuda" else 1
    # DeepSpeed reads its rank from the environment: such a rank runs in a child told it
    estimate_rank = _child.estimate_in_child if layout.strategy == "deepspeed" else (
        _plan.estimate_rank)  # fmt: skip
    roles = []
    for ranks in _plan.rank_groups(layout):
        usage: Usage = estimate_rank(layout, ranks[0], spec, round_to=round_to)
        fields = {f.name: getattr(usage, f.name) for f in dataclasses.fields(RankMemory)
                  if hasattr(usage, f.name)}  # fmt: skip
        roles.append(RankMemory(ranks=ranks, **fields))
    return MemoryEstimate(
        world_size=layout.world_size,
        parallelism=layout.parallelism,
        strategy=layout.strategy,
        precision=layout.precision,
        device=device,
        ranks=tuple(roles),
    )
