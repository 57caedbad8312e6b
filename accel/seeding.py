"""Seeding and the RNG states a checkpoint must carry for an exact resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from accel.context import RunContext

__all__ = ["get_rng_state", "set_rng_state", "set_seed"]


def check_seed(fn: str, seed: object) -> None:
    """Raise naming `fn` unless `seed` is None or an int in [0, 2**63) (torch's seed range)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{fn}: seed={seed!r} must be an int (or None); e.g. seed=42.")
    if not 0 <= seed < 2**63:
        raise ValueError(f"{fn}: seed={seed!r} must be in [0, 2**63); e.g. seed=42.")


def set_seed(seed: int, *, ctx: RunContext | None = None, deterministic: bool = False) -> int:
    """Seed Python's `random`, NumPy and torch (CPU and every CUDA device).

    Without `ctx` every rank uses `seed` (Accelerate's default). With `ctx`, each rank uses
    `seed + ctx.rank`, so data-parallel ranks draw different dropout masks and augmentations
    (Accelerate's `device_specific=True`). Either way `wrap_model` starts every rank from rank
    0's initial weights under DDP, FSDP2 and tensor parallelism.

    Args:
        seed: the base seed.
        ctx: when given, offsets the seed by the rank.
        deterministic: also ask torch for deterministic kernels
            (`torch.use_deterministic_algorithms(True)`), slower but repeatable on GPU.

    Returns:
        The seed this process used.

    Raises:
        ValueError: for a seed that is not a non-negative int.

    Example:
        >>> from accel import RunContext, set_seed
        >>> set_seed(0, ctx=RunContext(rank=1, world_size=2))
        1
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_seed: seed={seed!r} must be a non-negative int.")
    value = seed + (ctx.rank if ctx is not None else 0)
    if value >= 2**64:  # torch.manual_seed takes 64 bits
        raise ValueError(
            f"set_seed: seed={seed!r} is too large; torch seeds are below 2**64 (seed + rank). "
            "Pass a smaller seed, e.g. seed % 2**32."
        )
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return value


def get_rng_state() -> dict[str, Any]:
    """Capture the Python, NumPy, torch and CUDA RNG states of this process.

    The result holds only tensors, ints, strings and tuples, so it can be stored without pickle.
    CUDA states are captured only once CUDA is initialised (this call does not initialise it).

    Returns:
        A dict with "python", "numpy" and "torch" states, and "cuda" (one state per device,
        stacked) when CUDA is in use; pass it to `set_rng_state`.

    Example:
        >>> import torch
        >>> from accel import get_rng_state, set_rng_state
        >>> state = get_rng_state()
        >>> a = torch.rand(1); set_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    version, keys, gauss = random.getstate()
    np_state: Any = np.random.get_state(legacy=True)
    kind, np_keys, pos, has_gauss, cached = np_state
    state: dict[str, Any] = {
        "python": {
            "version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss,
        },
        "numpy": {
            "kind": kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators to states captured by `get_rng_state`.

    The CUDA states are restored only when the state has them and CUDA is available.

    Args:
        state: the dict `get_rng_state` returned (in this process or another with the same
            number of CUDA devices).

    Example:
        >>> import numpy as np
        >>> from accel import get_rng_state, set_rng_state
        >>> state = get_rng_state()
        >>> a = np.random.rand(); set_rng_state(state); bool(np.random.rand() == a)
        True
    """
    py = state["python"]
    random.setstate((py["version"], tuple(int(k) for k in py["keys"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached"],
        )
    )
    # torch.set_rng_state reads a view's storage from its offset 0 (a wrong state, or a crash
    # in native code): a state read back from a checkpoint's file is such a view, so it gets
    # memory of its own here.
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
