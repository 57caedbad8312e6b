"""The device canary: on a CPU, tell the run's device from the host as a GPU would.

On a CPU every tensor is on the same device, so a tensor made on the default device (the host)
meeting a model on `ctx.device` computes happily here and fails on the first GPU. Under
`DeviceCanary` the run's device is `torch.device("cpu", 0)`: CPU memory and real values, so
accel's CPU code paths run and losses are real, but a device of its own. A torch function mode
records where each tensor's memory lives:

- on the run's device: what is created with `device=` that device (or `x.device` of a tensor on
  it), moved there with `.to(...)`, or computed from such tensors;
- on the host: what is created without a device (the default device, as on a GPU machine),
  with `device="cpu"`, moved with `.cpu()` / `.to("cpu")`, or computed from host tensors only.

An op that mixes the two (a host tensor that is not a 0-dim scalar, which CUDA kernels accept)
raises the RuntimeError CUDA raises, as does `.numpy()` of a tensor on the run's device. Where
accel picked the backend for the run's device (`init_distributed` and `run_world` with none
named), the process group stands for NCCL, a GPU run's backend: a collective given a host tensor
raises what NCCL raises (gloo, underneath, takes either; NCCL takes tensors on the GPU only,
scalars included). A group the script made itself, with the backend it named, keeps its rules. The
record is kept per storage (weakly), so views, `nn.Parameter`s and `.data` share their tensor's
place. Tensors made where the mode cannot see (before it started, in other processes, by
autograd) are unknown until an op places them, and never raise. The engines' own code (FSDP2 and
DTensor in torch.distributed, DeepSpeed) names the device it was given, "cpu" on a CPU, for the
run's device: there it is read so.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CANARY_DEVICE", "DeviceCanary", "canary_device", "stand_for_nccl"]

# The run's device under the canary. Index 0 makes it differ from the host's torch.device("cpu")
# (a tensor made on it is a CPU tensor; its `.device` reads cpu:0 under the canary).
CANARY_DEVICE = torch.device("cpu", 0)

Place = Literal["device", "host"]

# Ops that legitimately take tensors from both places (copies between devices).
_MOVES_ALLOWED = frozenset(
    {
        torch.Tensor.copy_,
        torch.Tensor.new_tensor,
        torch.Tensor.set_,
        torch.Tensor.__deepcopy__,
        torch.Tensor.__reduce_ex__,
        torch._has_compatible_shallow_copy_type,
    }
)
_OWN_FILES = frozenset({__file__, torch.overrides.__file__})
_MODULE_FILE = torch.nn.modules.module.__file__
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})
_TO_NUMPY: tuple[Any, ...] = (torch.Tensor.numpy, torch.Tensor.__array__)
# The dispatcher's namespaces of torch.distributed's collectives (process groups; DTensor's).
_COLLECTIVES = frozenset({"c10d", "_c10d_functional"})


def canary_device() -> torch.device | None:
    """Return the canary's device when a `DeviceCanary` is active in this thread.

    Returns:
        `CANARY_DEVICE` inside `accel.testing.device_canary()`, else None.

    Example:
        >>> from accel.testing import device_canary
        >>> with device_canary():
        ...     canary_device()
        device(type='cpu', index=0)
        >>> canary_device() is None
        True
    """
    for mode in _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceCanary):
            return CANARY_DEVICE
    return None


def stand_for_nccl() -> None:
    """From here on, the active canary's collectives follow NCCL's rule (see the module's doc).

    `init_distributed` calls it when it picks the backend for the canary's device, as it would
    pick NCCL for a GPU; outside a canary it does nothing.

    Example:
        >>> with DeviceCanary() as canary:
        ...     stand_for_nccl()
        ...     canary.nccl
        True
    """
    for mode in _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceCanary):
            mode.nccl = True


def _place_of(device: Any) -> Place | None:
    """Where a `device=` argument puts a new tensor (None: not a CPU place the canary tracks)."""
    if device is None:
        return "host"  # the default device
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device) or device.type != "cpu":
        return None
    return "device" if device.index == 0 else "host"


def _named_place(device: Any) -> Place | None:
    """`_place_of` for a device the code named, read as the engines mean it.

    FSDP2 and DTensor name the mesh's device type ("cpu" on a gloo mesh) for the shards they
    move and the buffers they all-gather into, and DeepSpeed its accelerator's device ("cpu" on
    a CPU) for the module and the buffers it makes; that is the run's device, as their "cuda:N"
    is on a GPU. Only calls made from those engines' own code are read this way.
    """
    where = _place_of(device)
    return "device" if where == "host" and _called_from_an_engine() else where


# The packages whose code names the run's device "cpu" under the canary (see _named_place).
_ENGINES = ("torch.distributed.", "deepspeed.")


def _called_from_an_engine() -> bool:
    frame: Any = sys._getframe(1)
    # nn.Module.to passes its caller's device on: the caller named it
    while frame is not None and (
        frame.f_code.co_filename in _OWN_FILES or frame.f_code.co_filename == _MODULE_FILE
    ):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return bool(module.startswith(_ENGINES))


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def _on_host(tensors: Sequence[torch.Tensor]) -> str:
    """How the canary's errors name host tensors: their shapes and how a tensor gets there."""
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
    return f"on the host (shape {shapes}: made without a device, or moved with .cpu())"


def _storage(t: torch.Tensor) -> Any:
    if t.layout != torch.strided or t.device.type != "cpu":
        return None
    if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        return None  # DTensor and other wrapper subclasses: no storage of their own
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class DeviceCanary(TorchFunctionMode):
    """A torch function mode that fails device mix-ups on a CPU as CUDA fails them on a GPU.

    Use it through `accel.testing.device_canary()`; see this module's docstring for the rules.
    """

    def __init__(self, *, nccl: bool = False) -> None:
        super().__init__()
        self.nccl = nccl  # collectives refuse host tensors, as NCCL does
        self._places: weakref.WeakKeyDictionary[Any, Place] = weakref.WeakKeyDictionary()
        self._collectives = _NcclRule(self)

    def __enter__(self) -> DeviceCanary:
        self._collectives.__enter__()  # type: ignore[no-untyped-call]
        return super().__enter__()  # type: ignore[no-any-return, no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._collectives.__exit__(*exc)  # type: ignore[no-untyped-call]

    def place(self, t: torch.Tensor) -> Place | None:
        """Where `t` lives: "device", "host" or None (unknown to the canary)."""
        storage = _storage(t)
        return None if storage is None else self._places.get(storage)

    def _mark(self, t: torch.Tensor, where: Place | None, *, force: bool = False) -> None:
        storage = _storage(t)
        if where is not None and storage is not None and (force or storage not in self._places):
            self._places[storage] = where

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        descriptor, name = getattr(func, "__self__", None), getattr(func, "__name__", "")
        if name == "__get__" and descriptor is torch.Tensor.device:
            # the engines compare with the device they were given, "cpu" (see _named_place)
            on_device = self.place(args[0]) == "device" and not _called_from_an_engine()
            return CANARY_DEVICE if on_device else func(*args)
        if name == "__set__":  # `param.data = t` moves the storage with it; `.grad = t` too
            return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func in _TO_NUMPY and self.place(args[0]) == "device":
            raise TypeError(
                "device canary: can't convert a tensor on the run's device to numpy; on a GPU: "
                "\"can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                'the tensor to host memory first."'
            )
        inputs = [(t, self.place(t)) for t in _tensors((args, kwargs))]
        if func in _INDEXING:
            self._check_index(func, args)
        elif func not in _MOVES_ALLOWED:
            self._check_mix(func, inputs)
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None:
            where = _named_place(kwargs["device"])
        elif not inputs:
            where = "host"  # a factory without a device: the default device
        else:
            places = {p for _, p in inputs}
            where = "device" if "device" in places else "host" if "host" in places else None
        for t in _tensors(out):
            self._mark(t, where)
        return out

    def _check_mix(
        self, func: Callable[..., Any], inputs: list[tuple[torch.Tensor, Place | None]]
    ) -> None:
        on_device = [t for t, p in inputs if p == "device"]
        on_host = [t for t, p in inputs if p == "host" and t.dim() > 0]  # CPU scalars are fine
        if on_device and on_host:
            raise RuntimeError(
                f"device canary: {resolve_name(func) or func} got tensors {_on_host(on_host)} "
                "and on the run's device; on a GPU this fails with \"Expected all tensors to be "
                'on the same device, but found at least two devices, cuda:0 and cpu!". Create the '
                "tensor with device=ctx.device (or device=x.device), or move it with "
                ".to(ctx.device)."
            )

    def _check_index(self, func: Callable[..., Any], args: Sequence[Any]) -> None:
        # CUDA tensors may be indexed with CPU indices, not CPU tensors with CUDA indices.
        if self.place(args[0]) != "host" or args[0].dim() == 0:
            return
        if any(self.place(t) == "device" for t in _tensors(args[1])):
            raise RuntimeError(
                f"device canary: {resolve_name(func)} indexes a tensor on the host with indices "
                "on the run's device; on a GPU this fails with \"indices should be either on "
                'cpu or on the same device as the indexed tensor (cpu)". Move the indexed '
                "tensor to ctx.device, or the indices to the host with .cpu()."
            )

    def _move(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        source = args[0]
        if func is torch.Tensor.cpu:
            where: Place | None = "host"
        elif args[1:] and isinstance(args[1], torch.Tensor):  # .to(other): other's place
            where = self.place(args[1])
        elif "other" in kwargs:
            where = self.place(kwargs["other"])
        else:
            keys = {k: v for k, v in kwargs.items() if k != "copy"}  # not one of _parse_to's
            device = torch._C._nn._parse_to(*args[1:], **keys)[0]
            where = self.place(source) if device is None else _named_place(device)
        out = func(*args, **kwargs)
        here = self.place(source)
        shared = _storage(out) is not None and _storage(out) is _storage(source)
        if where is not None and where != here and shared:
            out = out.clone()  # a move between devices copies, as it does on a GPU
        self._mark(out, where if where is not None else here, force=where is not None)
        return out


class _NcclRule(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The canary's rule for collectives: every tensor a collective takes is on the run's device.

    Collectives reach the dispatcher as `c10d` ops whichever way they were called
    (torch.distributed's functions, a process group's methods, DTensor), so the rule is checked
    there, on the tensors the caller passed. Tensors of unknown place (made in C++, as a
    barrier's) pass.
    """

    def __init__(self, canary: DeviceCanary) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._canary = canary

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self._canary.nccl and func.namespace in _COLLECTIVES:
            given = [*args, *kwargs.values()]  # allgather's outputs are lists of lists
            on_host = [t for t in _tensors(given) if self._canary.place(t) == "host"]
            if on_host:
                raise RuntimeError(
                    f"device canary: the collective {func} got a tensor {_on_host(on_host)}; "
                    'on a GPU, NCCL fails with "No backend type associated with device type '
                    'cpu". Create the tensor with device=ctx.device, or move it with '
                    ".to(ctx.device), before the collective."
                )
        with torch._C.DisableTorchFunction():  # the op was placed by the canary's caller
            return func(*args, **kwargs)
