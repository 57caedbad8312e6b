"""The fake world: one process plays any rank of a world of any size, on tensors with no data.

`fake_world(rank, world_size)` creates torch's fake process group (collectives that move no
data, for any world size, in one process); `fake_tensors()` makes every floating-point tensor
created inside a `FakeTensor` (shape, dtype and device, no memory). Integer and boolean tensors
that no fake tensor produced stay real: a DeviceMesh's rank tables, token ids and masks are
small, and code that reads their values (a mesh's coordinates, a padding mask) then runs as it
would. A value read from a fake tensor (`.item()` of a loss, a shape that depends on data) is an
error naming the operator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FAKE_BACKEND = "fake"


def _create_fake_group(common: Any, backend_options: Any) -> Any:
    from torch._C._distributed_c10d import FakeProcessGroup

    make = FakeProcessGroup._create_internal  # (rank, size, options) in torch 2.13
    return make(common.group_rank, common.group_size, backend_options)  # type: ignore[call-arg]


def register_fake_backend() -> None:
    """Make the "fake" backend known to `init_process_group`, as torch's test helper does.

    torch ships the fake process group (`FakeProcessGroup`) and names its backend, but registers
    it only when its testing package is imported; accel does not depend on that package, so it
    registers the same backend itself. Registering twice changes nothing.
    """
    if FAKE_BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        FAKE_BACKEND, _create_fake_group, extended_api=True, devices=["cpu", "cuda"]
    )


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be rank `rank` of a fake world of `world_size` processes (no data moves) while inside."""
    if dist.is_initialized():
        raise RuntimeError(
            "estimate_memory: a process group is initialised in this process already; the "
            "estimate plays every rank of a fake world of its own. Call it before "
            "init_distributed, or in another process."
        )
    register_fake_backend()
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(FAKE_BACKEND, store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _RealIntegers(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Run an operator for real when no fake tensor takes part and it makes no float tensor.

    With `zero_reads`, reading a fake tensor's value (`.item()`) gives zero (False, 0, 0.0)
    instead of an error.
    """

    def __init__(self, *, zero_reads: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.zero_reads = zero_reads

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_fake(t) for t in tensors):
            if self.zero_reads and func is torch.ops.aten._local_scalar_dense.default:
                try:  # a fake tensor that holds a known constant (a step count) answers it
                    return func(*args, **kwargs)
                except DataDependentOutputException:
                    return _zero(tensors[0].dtype)
            return func(*args, **kwargs)
        if tensors and not any(_is_float(t) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)  # a factory: fake first, which tells its dtype for free
        if not tensors and isinstance(out, torch.Tensor) and not _is_float(out):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def _zero(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


@contextlib.contextmanager
def fake_tensors(*, zero_reads: bool = False) -> Iterator[FakeTensorMode]:
    """Make floating-point tensors created inside fake (see the module's docstring).

    `zero_reads`: a value read from a fake tensor is zero instead of an error (for an engine
    whose step reads a finite-gradient check: zero is a healthy step's answer).
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _RealIntegers(zero_reads=zero_reads):
        yield mode


def in_fake_world() -> bool:
    """Whether this process is inside `fake_world`."""
    return bool(dist.is_initialized() and dist.get_backend() == FAKE_BACKEND)
