"""DeepSpeed ZeRO through `wrap_model(ctx, model, strategy="deepspeed", deepspeed=...)`.

`DeepSpeedOptions` says what the engine is built from; `deepspeed_engine` finds the engine
behind a model or an optimizer (the step functions route to it with it). Importing this module
does not import deepspeed: only building an engine does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from accel._deepspeed_flags import ENGINE_REF

__all__ = ["DeepSpeedOptions", "build_deepspeed_ops", "deepspeed_engine"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSpeedOptions:
    """What `wrap_model(..., strategy="deepspeed")` builds a DeepSpeed engine from.

    DeepSpeed takes the optimizer when it builds the engine, so it is given here: create it
    over `model.parameters()` before `wrap_model` and keep using it in the loop
    (`optimizer_step(ctx, optimizer)` steps the engine; your scheduler keeps stepping it).
    Without one, the config's own "optimizer" section builds it (use `model.optimizer`).

    Example:
        >>> import torch
        >>> from accel import DeepSpeedOptions
        >>> model = torch.nn.Linear(2, 2)
        >>> opts = DeepSpeedOptions(
        ...     config={"zero_stage": 2}, optimizer=torch.optim.AdamW(model.parameters()),
        ...     micro_batch_size=8)
        >>> opts.micro_batch_size
        8
    """

    config: Mapping[str, Any] | str | os.PathLike[str] | None = None
    """A DeepSpeed config (dict or JSON path), or Accelerate's `deepspeed_config` section
    (`zero_stage`, `offload_optimizer_device`, ..., `deepspeed_config_file`). "auto" values are
    filled from the context (precision, accumulation, batch sizes, clipping). None: the
    launcher's (`ctx.wrap.deepspeed`, from `accel launch` with a DeepSpeed YAML or flags)."""
    optimizer: torch.optim.Optimizer | None = None
    """Your optimizer over the model's parameters; None when the config has an optimizer."""
    micro_batch_size: int | None = None
    """Samples per rank in one forward: fills train_micro_batch_size_per_gpu="auto"."""

    def __post_init__(self) -> None:
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DeepSpeedOptions: optimizer={type(self.optimizer).__name__} must be a "
                "torch.optim.Optimizer built over model.parameters(), or None."
            )
        m = self.micro_batch_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(
                f"DeepSpeedOptions: micro_batch_size={m!r} must be an int >= 1 (samples per "
                "rank in one forward), or None to take the config's."
            )


def deepspeed_engine(obj: object) -> Any:
    """Return the DeepSpeed engine behind a model or optimizer, or None.

    The model `wrap_model(..., strategy="deepspeed")` returned is the engine (also inside
    `torch.compile`); the module given to it (`unwrap_model(engine)`), the optimizer given in
    `DeepSpeedOptions`, and the engine's own optimizer lead to it. Costs a dict lookup when
    deepspeed was never imported.

    Args:
        obj: a model or an optimizer.

    Returns:
        The `deepspeed.DeepSpeedEngine`, or None.

    Example:
        >>> import torch
        >>> from accel import deepspeed_engine
        >>> deepspeed_engine(torch.nn.Linear(2, 2)) is None
        True
    """
    ds = sys.modules.get("deepspeed")
    if ds is None:
        return None
    inner = getattr(obj, "_orig_mod", obj) if isinstance(obj, torch.nn.Module) else obj
    if isinstance(inner, ds.DeepSpeedEngine):
        return inner
    ref = getattr(obj, ENGINE_REF, None)
    return ref() if ref is not None else None


def build_deepspeed_ops(*, remove_stale_lock: bool = False) -> float:
    """Build (or load) the C++ ops a CPU DeepSpeed run needs; return the seconds it took.

    DeepSpeed compiles its shared-memory communication op the first time an engine starts on
    a CPU (minutes), into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`).
    Call this once ahead (`make deepspeed-ops` does). Builds never overlap: each holds a file
    lock beside the build folder. A build that was killed leaves torch's `lock` file, which
    would make every later build wait forever; it is removed with `remove_stale_lock=True`,
    else named in an error.

    Args:
        remove_stale_lock: delete torch's leftover `lock` file of a killed build.

    Returns:
        Seconds spent (about 0.1 when built already).

    Raises:
        ImportError: without the `deepspeed` extra.
        RuntimeError: for a stale lock with `remove_stale_lock=False`.

    Example:
        >>> from accel import build_deepspeed_ops
        >>> build_deepspeed_ops() >= 0  # doctest: +SKIP
        True
    """
    from accel.parallel import _deepspeed_ops  # on use: it imports deepspeed

    return _deepspeed_ops.build_ops(remove_stale_lock=remove_stale_lock)
