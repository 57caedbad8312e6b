"""Profile a block of training with `torch.profiler`, one Chrome trace per rank.

The equivalent of Accelerate's `ProfileKwargs` + `accelerator.profile()`: the options are the
profiler's own, passed straight through; what accel adds is the per-rank file name, so the
ranks of one run never overwrite each other's traces, and a default set of activities that
follows the context's device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from accel.context import RunContext

__all__ = ["profile"]

_ACTIVITIES = MappingProxyType({"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA})
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")

Schedule = Callable[[int], ProfilerAction]


def _activities(
    ctx: RunContext, activities: Sequence[str | ProfilerActivity] | None
) -> list[ProfilerActivity]:
    if activities is None:
        return [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else []
        )
    chosen = []
    for activity in activities:
        value = _ACTIVITIES.get(activity) if isinstance(activity, str) else activity
        if not isinstance(value, ProfilerActivity):
            raise ValueError(
                f"profile: activities contains {activity!r}; expected 'cpu', 'cuda' or a "
                "torch.profiler.ProfilerActivity. Pass activities=['cpu'] or leave it None."
            )
        if value == ProfilerActivity.CUDA and not torch.cuda.is_available():
            raise ValueError(
                f"profile: activities contains {activity!r} but CUDA is not available here; "
                "profile 'cpu' only, or leave activities=None to follow ctx.device."
            )
        chosen.append(value)
    return chosen


def _schedule(schedule: Mapping[str, int] | Schedule | None) -> Schedule | None:
    if schedule is None or callable(schedule):
        return schedule
    if not isinstance(schedule, Mapping) or set(schedule) - set(_SCHEDULE_KEYS):
        raise ValueError(
            f"profile: schedule={schedule!r} is not a schedule; expected a "
            f"torch.profiler.schedule(...) or a dict of {_SCHEDULE_KEYS} (Accelerate's "
            "schedule_option). Pass e.g. schedule={'wait': 1, 'warmup': 1, 'active': 3}."
        )
    return torch.profiler.schedule(**schedule)


@contextlib.contextmanager
def profile(
    ctx: RunContext,
    *,
    activities: Sequence[str | ProfilerActivity] | None = None,
    schedule: Mapping[str, int] | Schedule | None = None,
    output_dir: str | os.PathLike[str],
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    with_flops: bool = False,
) -> Iterator[torch.profiler.profile]:
    """Profile the block with `torch.profiler` and write this rank's Chrome trace.

    Enter it on every rank that should be profiled (nothing is synchronised). Without a
    schedule the whole block is recorded and written on exit to
    `output_dir/profile_{rank}.json`, Accelerate's name. With a schedule, call `prof.step()`
    once per training step, as with torch's profiler; each active cycle is written when it
    ends, to `output_dir/profile_{rank}_step{N}.json` (N: the step at which it ended). Open
    the files in Perfetto (https://ui.perfetto.dev) or chrome://tracing.

    Args:
        ctx: the run context; its rank names the file, its device picks the activities.
        activities: "cpu", "cuda" or `torch.profiler.ProfilerActivity` values; None records
            the CPU, and CUDA when `ctx.device` is a GPU.
        schedule: a `torch.profiler.schedule(...)` or a dict of its arguments (`wait`,
            `warmup`, `active`, `repeat`, `skip_first`, Accelerate's `schedule_option`);
            None records every step.
        output_dir: the folder for the traces; created if missing.
        record_shapes: record the input shapes of each op.
        profile_memory: record tensor allocations and frees.
        with_stack: record the Python source location of each op.
        with_flops: estimate the FLOPs of matmuls and convolutions.

    Yields:
        The running `torch.profiler.profile`: call `.step()` on it each step when a schedule
        is given; `.key_averages()` summarises it after the block.

    Raises:
        ValueError: for an unknown activity, CUDA asked for where there is none, or a
            schedule that is neither a callable nor a dict of the schedule's arguments.
        TypeError: when `output_dir` is not a path.

    Example:
        >>> from accel import RunContext, profile
        >>> import torch
        >>> import tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with profile(RunContext(), output_dir=folder):
        ...         _ = torch.ones(4) @ torch.ones(4)
        ...     sorted(p.name for p in Path(folder).iterdir())
        ['profile_0.json']
    """
    if not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(
            f"profile: output_dir={output_dir!r} must be a path (str or os.PathLike), e.g. "
            "output_dir='traces'."
        )
    folder = Path(output_dir)
    chosen = _activities(ctx, activities)
    steps = _schedule(schedule)

    def write(prof: torch.profiler.profile) -> None:
        suffix = "" if steps is None else f"_step{prof.step_num}"
        prof.export_chrome_trace(str(folder / f"profile_{ctx.rank}{suffix}.json"))

    folder.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {
        "activities": chosen, "schedule": steps, "on_trace_ready": write,
        "record_shapes": record_shapes, "profile_memory": profile_memory,
        "with_stack": with_stack, "with_flops": with_flops,
        # Without a schedule there is one cycle, so nothing is cleared between cycles; saying
        # so keeps torch 2.11 from warning at the start that events are cleared after each.
        "acc_events": steps is None,
    }  # fmt: skip
    with torch.profiler.profile(**options) as prof:
        yield prof
