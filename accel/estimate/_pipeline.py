"""One pipeline rank's training step: its stages of the model, their optimizer, one schedule step.

The rank builds the whole model, keeps its stages with `pipeline_stages`' own code (each
wrapped by `wrap_model` as the layout's other mesh dimensions say), and runs one
`pipeline_step` of torch's schedule over its microbatches, as a pipelined training loop does.
In the fake world no neighbouring stage answers, so the rank finds every stage's input and
output shapes itself (the whole model run on one microbatch, before the step) and gives them to
its stages up front, which torch's stages then use instead of asking their neighbours.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from accel.context import RunContext
from accel.estimate._account import MemoryAccount
from accel.estimate._fake import in_fake_world
from accel.estimate._spec import StepSpec, Trainer, make_batch, make_optimizer, score, token_range
from accel.parallel import pipeline_stages, pipeline_step, wrap_model
from accel.precision import autocast


def pipeline_trainer(ctx: RunContext, spec: StepSpec) -> Trainer:
    """This rank's stages (of the pp group's `ctx.pp_size`), ready for one schedule step."""
    if ctx.wrap.deepspeed is not None:
        raise NotImplementedError(
            f"estimate_memory: pp={ctx.pp_size} with DeepSpeed: accel runs pipeline stages "
            "with torch's schedules, not DeepSpeed's pipeline engine; estimate pp=1 for "
            "DeepSpeed, or pipeline stages with FSDP2 (--use_fsdp)."
        )
    model = spec.build()
    high = token_range(spec.batch, model)
    microbatches = spec.microbatches or ctx.pp_size
    example = None
    if in_fake_world():  # no neighbour answers: every stage's shapes from one microbatch here
        first = _inputs(make_batch(spec.batch, high, ctx.device))
        example = tuple(torch.tensor_split(first, microbatches)[:1])
    tp = ctx.parallelism is not None and ctx.parallelism.tp > 1
    plan = (spec.tp_plan if spec.tp_plan is not None else "auto") if tp else None
    with autocast(ctx):  # the shapes found are those the step's forward sends
        stages = pipeline_stages(
            ctx, model, loss_fn=functools.partial(_loss, spec.loss), microbatches=microbatches,
            schedule=spec.schedule,  # type: ignore[arg-type]
            wrap=lambda m: wrap_model(ctx, m, tp_plan=plan),  # type: ignore[arg-type]
            example_inputs=example,
        )  # fmt: skip
    del model  # the other stages' weights go with it, as in a pipelined run
    if example is not None:
        _vote_static(stages.schedule)
    optimizer = make_optimizer(spec.optimizer, list(stages.parameters()), spec.device_type)

    def forward_backward(account: MemoryAccount, batch: Any) -> None:
        with account.phase_of("pipeline"), autocast(ctx):
            pipeline_step(ctx, stages, batch, batch)

    ids = ", ".join(str(i) for i in stages.stage_ids)
    role = f"pp stage{'s' if len(stages.stage_ids) > 1 else ''} {ids}"
    return Trainer(
        role=role + (" (last: the head)" if stages.has_last else ""),
        modules=stages.modules,
        optimizer=optimizer,
        engine=False,
        make_batch=lambda: _inputs(make_batch(spec.batch, high, ctx.device)),
        forward_backward=forward_backward,
    )


def _inputs(batch: Any) -> torch.Tensor:
    """The first stage's input (also the loss's target): one tensor."""
    if not isinstance(batch, torch.Tensor):
        raise ValueError(
            f"estimate_memory: under pipeline parallelism the batch is the first stage's input "
            f"and the last stage's target, one tensor; the batch callable returned a "
            f"{type(batch).__name__}. Return one tensor, or pass the shape of token ids."
        )
    return batch


def _loss(loss: Any, output: Any, target: Any) -> Any:
    return score(output, target, loss)


def _vote_static(schedule: Any) -> None:
    """Answer torch's warm-up vote on this rank: every stage was given its shapes (static).

    Before the first step, torch's stages vote along the pipeline on whether each knows its
    shapes; in the fake world the neighbours' votes never arrive (a receive there leaves its
    buffer as it was), so the rank gives the answer the whole pipeline would have given.
    """
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage._warmup_forward_vote = _static_vote
        stage._warmup_backward_result = _static_vote


def _static_vote(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.ones(1, dtype=torch.int32)
