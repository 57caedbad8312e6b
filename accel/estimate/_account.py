"""Account every live tensor storage of one rank's step, by what it holds, and keep the peak.

`MemoryAccount` is a TorchDispatchMode: every tensor an operator returns is added under the
category of the phase it was made in (activations in forward, temporaries in backward, optimizer
state in the step); parameters, gradients and communication buffers are named when they are
known (the model's tensors, each parameter's `.grad`, the tensors handed to a collective). A
storage leaves the account when it is freed (a weakref finalizer) or resized to nothing. The
same account runs on fake tensors (the estimate) and on real ones (the measurement it is
checked against), so both count exactly the same things.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication")
"""What a rank's memory holds, in report order; the batch and backward's temporaries count as
activations, FSDP2's gathered parameters and every collective's buffers as communication."""

_PHASE_CATEGORY = MappingProxyType(
    {"setup": "parameters", "forward": "activations", "backward": "activations",
     "optimizer": "optimizer_state", "pipeline": "activations"}
)  # fmt: skip
_c10d = torch.ops.c10d
# In-place collectives: what their first argument (output or buffer) and second (the buffer
# sent) are. A reduce-scatter's output becomes the sharded gradients (FSDP2's, ZeRO's).
_COLLECTIVES = MappingProxyType(
    {
        _c10d._reduce_scatter_base_.default: ("gradients", "communication"),
        _c10d.reduce_scatter_tensor_coalesced_.default: ("gradients", "communication"),
        _c10d.reduce_.default: ("gradients",),  # DeepSpeed's ZeRO-1/2 gradient bucket
        **dict.fromkeys(
            (_c10d._allgather_base_.default, _c10d.allreduce_.default, _c10d.broadcast_.default,
             _c10d.allgather_.default, _c10d.reduce_scatter_.default,
             _c10d.allgather_into_tensor_coalesced_.default, _c10d.allreduce_coalesced_.default,
             _c10d.send.default, _c10d.recv_.default),
            ("communication", "communication"),
        ),
    }
)  # fmt: skip


def storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor: its own, or its inner tensors' (DTensor's local shard)."""
    if is_traceable_wrapper_subclass(tensor):  # type: ignore[unreachable]
        names, _ = tensor.__tensor_flatten__()  # type: ignore[unreachable]
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    elif isinstance(tensor, torch.Tensor):
        yield tensor.untyped_storage()


class MemoryAccount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes held by live storages, per category, now and at the peak (one rank, one device).

    `round_to` rounds each storage up to a multiple (the CUDA caching allocator's 512 bytes);
    1 counts bytes as they are.
    """

    def __init__(self, *, round_to: int = 1, host: frozenset[str] = frozenset()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.round_to = round_to
        self.host = host
        """Categories held in host memory (CPU offload): outside the device's peak."""
        self.host_peak = 0
        self.phase = "setup"
        self.now = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict(self.now)
        self.peak_phase = "setup"
        # id(storage) -> [bytes, category], and a weak reference whose finalizer forgets it.
        self._live: dict[int, list[Any]] = {}
        self._fake_on_entry: Any = None
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    @property
    def total(self) -> int:
        """Bytes on the device now (every category but those in host memory)."""
        return sum(v for c, v in self.now.items() if c not in self.host)

    @property
    def peak_total(self) -> int:
        return sum(self.peak.values())

    def _size(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        return -(-n // self.round_to) * self.round_to

    def _forget(self, key: int, ref: Any = None) -> None:
        if ref is not None and self._refs.get(key) is not ref:
            return  # the id was reused by a storage counted since
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.now[entry[1]] -= entry[0]

    def track(self, tensors: Iterable[Any], category: str) -> None:
        """Count the storages of `tensors` under `category` (moving known ones to it)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in storages(t):
                self._add(storage, category, move=True)
        self._check_peak()

    def _add(self, storage: torch.UntypedStorage, category: str, *, move: bool) -> None:
        key = id(storage)
        entry = self._live.get(key)
        ref = self._refs.get(key)
        if entry is not None and ref is not None and ref() is not None:
            size = self._size(storage)
            if size != entry[0]:  # resized (FSDP2 frees and refills gathered parameters)
                self.now[entry[1]] += size - entry[0]
                entry[0] = size
            if move and entry[1] != category:
                self.now[entry[1]] -= entry[0]
                self.now[category] += entry[0]
                entry[1] = category
            return
        if entry is not None:  # a dead storage whose id was reused before its finalizer ran
            self._forget(key)
        size = self._size(storage)
        self._live[key] = [size, category]
        self._refs[key] = weakref.ref(storage, functools.partial(self._forget, key))
        self.now[category] += size

    def _add_buffer(self, storage: torch.UntypedStorage, role: str) -> None:
        """A collective's buffer: counted under `role`, unless it holds the weights (DeepSpeed
        gathers its updated partitions straight into the flat weights they are views of)."""
        entry = self._live.get(id(storage))
        self._add(storage, role, move=entry is None or entry[1] != "parameters")

    def set_aside(self, weights: Iterable[Any]) -> None:
        """Move what setup made beyond `weights` (DDP's buckets) to communication."""
        mine = {id(s) for t in weights if isinstance(t, torch.Tensor) for s in storages(t)}
        for key, entry in self._live.items():
            if entry[1] == "parameters" and key not in mine:
                self.now["parameters"] -= entry[0]
                self.now["communication"] += entry[0]
                entry[1] = "communication"

    def _check_peak(self) -> None:
        if self.total > self.peak_total:
            self.peak = {c: 0 if c in self.host else v for c, v in self.now.items()}
            self.peak_phase = self.phase
        self.host_peak = max(self.host_peak, sum(self.now[c] for c in self.host))

    def restart_peak(self, phase: str) -> None:
        """Start the peaks again from what is held now."""
        self.peak = {c: 0 if c in self.host else v for c, v in self.now.items()}
        self.peak_phase = phase
        self.host_peak = sum(self.now[c] for c in self.host)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Update a storage after `UntypedStorage.resize_` (which no dispatch mode sees)."""
        entry = self._live.get(id(storage))
        if entry is None:
            self._add(storage, "communication", move=False)  # FSDP2's gathered parameters
        else:
            size = self._size(storage)
            self.now[entry[1]] += size - entry[0]
            entry[0] = size
        self._check_peak()

    def __enter__(self) -> MemoryAccount:
        self._fake_on_entry = active_fake_mode()
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_on_entry:
            return out  # DTensor's sharding propagation on its own fake tensors: no memory
        category = _PHASE_CATEGORY[self.phase]
        roles = _COLLECTIVES.get(func)
        if roles is not None and self.phase != "setup":  # setup: the weights broadcast
            for arg, role in zip(args, roles, strict=False):
                for t in tree_leaves(arg):
                    if isinstance(t, torch.Tensor):
                        for storage in storages(t):
                            self._add_buffer(storage, role)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in storages(t):
                    self._add(storage, category, move=False)
        self._check_peak()
        return out

    @contextlib.contextmanager
    def phase_of(self, phase: str) -> Iterator[None]:
        """Count what is made inside as made in `phase`."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before


@contextlib.contextmanager
def watching_resizes(account: MemoryAccount) -> Iterator[None]:
    """Tell `account` of every storage resize while inside.

    `UntypedStorage.resize_` reaches no dispatch mode, and FSDP2 frees and refills its gathered
    parameters with it; torch's own MemTracker patches the method the same way for the same
    reason. Restored on exit.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        account.resized(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
