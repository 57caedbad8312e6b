"""The torch.distributed.pipelining schedule over a rank's stage modules, and stage shapes.

torch's stages learn the shapes they receive and send by exchanging them with the neighbouring
stages in the first step. Given one microbatch of the first stage's inputs (`stage_shapes`), a
rank can instead find every stage's input and output shapes itself, by running the whole
model's stages in order on it, and hand them to its stages up front (torch's static mode):
what the memory estimate does in its fake world, where no neighbour answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from accel.context import RunContext, along

StageShapes = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
"""A stage's example (inputs, outputs) for one microbatch: only their shapes and dtypes count."""


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def stage_shapes(stage_modules: Sequence[nn.Module], example: tuple[Any, ...]) -> list[StageShapes]:
    """Each stage's (inputs, outputs), running the stages in order on one microbatch.

    Runs under whatever autocast the caller holds (the dtypes a stage sends are those of the
    step's forward) and with gradients on, since whether a tensor requires a gradient is part
    of what a stage must know (it sends gradients back only for those); each stage's outputs
    are detached before the next stage takes them, so no graph outlives its stage.
    """
    shapes: list[StageShapes] = []
    inputs = example
    for module in stage_modules:
        outputs = tuple(_detached(t) for t in _as_tuple(module(*inputs)))
        shapes.append((inputs, outputs))
        inputs = outputs
    return shapes


def _detached(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)


def build_schedule(
    ctx: RunContext,
    modules: list[nn.Module],
    ids: tuple[int, ...],
    num_stages: int,
    schedule: tuple[str, str],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    shapes: Sequence[StageShapes] | None = None,
) -> Any:
    """torch's schedule `schedule` (class name, stage layout) over this rank's stages.

    `shapes`, one entry per stage of the whole model, gives each stage its input and output
    shapes up front; None lets the stages learn them from their neighbours in the first step.
    """
    if ctx.pp_size == 1:
        return None  # one stage on one rank: pipeline_step runs the microbatches itself
    from torch.distributed.pipelining import PipelineStage, schedules

    group = along(ctx, "pp").process_group
    stages = []
    for module, i in zip(modules, ids, strict=True):
        inputs, outputs = (None, None) if shapes is None else shapes[i]
        stage = PipelineStage(
            module, i, num_stages, ctx.device, input_args=inputs, output_args=outputs,
            group=group,
        )  # fmt: skip
        _no_sends_to_self(stage, along(ctx, "pp").rank)
        stages.append(stage)
    cls, layout = schedule
    first = stages[0] if layout == "single" else stages
    return getattr(schedules, cls)(first, microbatches, loss_fn=loss_fn)


def _no_sends_to_self(stage: Any, own: int) -> None:
    """Drop the schedule's warm-up sends between two stages of this rank.

    Before the first step, each stage sends a dummy tensor to its neighbours to open the
    connections. Under a V schedule (zbv, dualpipev) the middle two stages sit on one rank, and
    torch 2.11's gloo cannot send to its own rank ("Pair is not connected"); a rank needs no
    connection to itself, and the schedule passes activations between its own stages in memory.
    """
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warm_up is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [
            op for op in warm_up() if getattr(op, "group_peer", None) != own
        ]
