"""Big models: build empty, plan a device map, stream a checkpoint in, offload the rest.

A model larger than any one device is built on the meta device (`init_empty_weights`), planned
(`infer_device_map`, pure: any `max_memory` works without those devices present), and loaded
shard by shard (`dispatch_checkpoint`). Modules mapped to "cpu" or "disk" run through hooks
(accel.hooks) that bring their weights to the execution device only for their forward.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from accel import _device_map as dm
from accel._checkpoint_files import resolve_checkpoint
from accel._device_map import Device
from accel._offload import (
    ST_DTYPES,
    DiskTensor,
    HeaderEntry,
    check_writable,
    read_header,
    write_index,
    write_tensor,
)
from accel.hooks import Slot, attach, attach_input_move

__all__ = [
    "compute_module_sizes",
    "cpu_offload",
    "disk_offload",
    "dispatch_checkpoint",
    "infer_device_map",
    "init_empty_weights",
    "init_on_device",
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
UNITS = tuple(_UNITS.items())
del _UNITS


@contextmanager
def init_on_device(device: torch.device | str, *, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter (and buffer, if asked) built inside the block on `device`.

    On "meta" nothing is allocated: shapes and dtypes only. Buffers stay on the CPU by default
    because many are computed at build time (rotary tables) and are not in checkpoints.
    The block patches `nn.Module.register_parameter` (and `register_buffer`) for its duration;
    build models in it from one thread at a time.

    Example:
        >>> import torch, accel
        >>> with accel.init_on_device("meta"):
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.device
        device(type='meta')
    """
    device = torch.device(device)
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(self, name, param)
        p = self._parameters[name]
        if p is not None and p.device != device:  # already there: keep it (and its ties)
            self._parameters[name] = nn.Parameter(p.to(device), p.requires_grad)

    def buffer(
        self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(self, name, tensor, persistent)
        if tensor is not None and tensor.device != device:
            self._buffers[name] = tensor.to(device)

    nn.Module.register_parameter = parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build a model with no memory: parameters created inside the block live on "meta".

    Fill it afterwards with `dispatch_checkpoint` (or `load_state_dict(..., assign=True)`).

    Example:
        >>> import torch, accel
        >>> with accel.init_empty_weights():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(10_000, 10_000) for _ in range(100)])
        >>> sum(p.numel() for p in model.parameters())
        10001000000
    """
    with init_on_device("meta", include_buffers=include_buffers):
        yield


def compute_module_sizes(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Return the bytes of parameters and buffers under each module name ("" is the model).

    A tied tensor counts once (at its first name); with `dtype`, floating-point tensors are
    counted at that dtype's size (integer buffers keep theirs). Works on meta models.

    Example:
        >>> import torch, accel
        >>> accel.compute_module_sizes(torch.nn.Linear(4, 2), dtype=torch.float16)
        {'': 20}
    """
    return dm.module_sizes(model, dtype)


def infer_device_map(
    model: nn.Module,
    *,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split: Iterable[str | type] = (),
    dtype: torch.dtype | None = None,
) -> dict[str, Device]:
    """Plan where each module lives: greedy in module order over accelerators, "cpu", "disk".

    Modules fill accelerator 0, 1, ..., then "cpu", then "disk" (only the devices named in
    `max_memory`). A module that does not fit is split into its children, unless its class is in
    `no_split`. When later modules are offloaded, room for the largest of them is kept on the
    first device, which runs them. Tied tensors stay on one device. Pure: nothing is allocated.

    Args:
        model: the model (usually built under `init_empty_weights`).
        max_memory: bytes per device, e.g. `{0: "10GiB", "cpu": 2**34, "disk": 10**12}`.
            Default: the free memory of each CUDA device and 90% of available RAM.
        no_split: classes (or class names) never split across devices (residual blocks).
        dtype: size floating-point tensors as this dtype (the dtype you will load in).

    Returns:
        Module or tensor name -> device (an accelerator index, "cpu" or "disk"), in module order.

    Raises:
        ValueError: a bad `max_memory`, or budgets too small for the model.

    Example:
        >>> import torch, accel
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])  # 80 B each
        >>> accel.infer_device_map(model, max_memory={0: 250, "cpu": 1000})
        {'0': 0, '1': 0, '2': 'cpu', '3': 'cpu'}
    """
    budgets = _max_memory("infer_device_map", max_memory)
    names = frozenset(c if isinstance(c, str) else c.__name__ for c in no_split)
    root = dm.build_units(model, names, dtype)
    return dm.plan(root, budgets)


def dispatch_checkpoint(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: Literal["auto"] | Mapping[str, Device] = "auto",
    max_memory: Mapping[Device, int | str] | None = None,
    no_split: Iterable[str | type] = (),
    offload_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> nn.Module:
    """Load a safetensors checkpoint into an empty model shard by shard, placing each module.

    Each shard is opened once and its tensors go straight into place (no full state dict).
    Modules on "cpu" (when an accelerator runs the model) or "disk" get hooks that bring their
    weights to the execution device for their forward. Disk weights are mapped in place from
    the safetensors file when possible, else written to `offload_dir` as numpy memmaps.

    Args:
        model: a model built under `init_empty_weights` (or a real one, overwritten).
        checkpoint: a .safetensors file, a sharded index .json, or a folder holding either.
        device_map: "auto" (plan with `infer_device_map`) or module/tensor name -> device.
        max_memory: budgets for "auto"; with `offload_dir` and no "disk" entry, disk is
            unlimited.
        no_split: classes (or names) never split across devices.
        offload_dir: folder for disk-offloaded weights that must be rewritten (dtype change).
        dtype: cast floating-point weights to this dtype while loading.
        strict: refuse checkpoints with missing or unexpected keys (missing keys that would
            leave a meta tensor are refused either way).

    Returns:
        The same model, loaded and dispatched. Use `remove_hooks` to drop the hooks.

    Raises:
        ValueError: missing/unexpected keys, a shape mismatch, a device map that misses a
            tensor or splits tied weights, an unwritable `offload_dir`, budgets too small.
        FileNotFoundError: the checkpoint or a shard does not exist.

    Example:
        >>> import tempfile, torch, accel
        >>> from safetensors.torch import save_file
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> save_file(torch.nn.Linear(2, 2).state_dict(), path)
        >>> with accel.init_empty_weights():
        ...     model = torch.nn.Linear(2, 2)
        >>> model = accel.dispatch_checkpoint(model, path, device_map={"": "disk"})
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    fn = "dispatch_checkpoint"
    folder = check_writable(fn, offload_dir) if offload_dir is not None else None
    entries = _checkpoint_entries(fn, checkpoint)
    layout = _Layout(model)
    _check_keys(fn, layout, entries, strict)
    if device_map == "auto":
        budgets = _max_memory(fn, max_memory)
        if folder is not None and "disk" not in budgets:
            budgets["disk"] = 2**62
        device_map = infer_device_map(model, max_memory=budgets, no_split=no_split, dtype=dtype)
    elif not isinstance(device_map, Mapping):
        raise TypeError(
            f"{fn}: device_map={device_map!r} must be 'auto' or a dict of name -> device."
        )
    elif max_memory is not None or no_split:
        warnings.warn(
            f"{fn}: max_memory and no_split only shape device_map='auto'; they are ignored with "
            "the device_map you passed.",
            stacklevel=2,
        )
    placement = layout.place(fn, device_map)
    execution = _execution_device(device_map)
    sources = _load(fn, layout, entries, placement, execution, folder, dtype)
    _hook(model, layout, device_map, sources, execution)
    return model


def cpu_offload(
    model: nn.Module, *, execution_device: torch.device | str | int | None = None
) -> nn.Module:
    """Keep `model`'s weights on the CPU and move each module's to `execution_device` only for
    its forward.

    Args:
        model: a model in memory.
        execution_device: where forwards run; default the current CUDA device, else the CPU.

    Returns:
        The same model, hooked (undo with `remove_hooks`).

    Example:
        >>> import torch, accel
        >>> model = accel.cpu_offload(torch.nn.Linear(2, 2), execution_device="cpu")
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    device = _device_arg(execution_device)
    layout = _Layout(model)
    sources: dict[str, torch.Tensor | DiskTensor] = {
        n: layout.tensors[n].detach().cpu() for n in layout.canonical_names()
    }
    _hook_each_module(model, layout, sources, device)
    return model


def disk_offload(
    model: nn.Module,
    *,
    offload_dir: str | os.PathLike[str],
    execution_device: torch.device | str | int | None = None,
) -> nn.Module:
    """Write `model`'s weights to `offload_dir` as numpy memmaps and read each module's back,
    lazily, only for its forward.

    Args:
        model: a model in memory (its tensors are replaced by meta placeholders).
        offload_dir: a writable folder; it receives one `.dat` per tensor and `index.json`.
        execution_device: where forwards run; default the current CUDA device, else the CPU.

    Returns:
        The same model, hooked (undo with `remove_hooks`).

    Example:
        >>> import tempfile, torch, accel
        >>> model = accel.disk_offload(torch.nn.Linear(2, 2), offload_dir=tempfile.mkdtemp())
        >>> model.weight.device
        device(type='meta')
    """
    folder = check_writable("disk_offload", offload_dir)
    device = _device_arg(execution_device)
    layout = _Layout(model)
    sources: dict[str, torch.Tensor | DiskTensor] = {
        n: write_tensor(folder, n, layout.tensors[n]) for n in layout.canonical_names()
    }
    write_index(folder, {n: s for n, s in sources.items() if isinstance(s, DiskTensor)})
    _hook_each_module(model, layout, sources, device)
    return model


class _Layout:
    """Where each tensor of a model is held: every name, its owner, tied aliases."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tensors: dict[str, torch.Tensor] = {}
        self.owner: dict[str, tuple[nn.Module, str, bool]] = {}
        self.canonical: dict[str, str] = {}
        self.persistent: set[str] = set()
        first: dict[int, str] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            items = [(n, t, True) for n, t in module._parameters.items()]
            items += [(n, t, False) for n, t in module._buffers.items()]
            for attr, t, is_param in items:
                if t is None:
                    continue
                name = dot + attr
                self.tensors[name] = t
                self.owner[name] = (module, attr, is_param)
                self.canonical[name] = first.setdefault(id(t), name)
                if is_param or attr not in module._non_persistent_buffers_set:
                    self.persistent.add(name)

    def canonical_names(self) -> list[str]:
        return [n for n, c in self.canonical.items() if n == c]

    def aliases(self, canonical: str) -> list[str]:
        return [n for n, c in self.canonical.items() if c == canonical]

    def place(self, fn: str, device_map: Mapping[str, Device]) -> dict[str, Device]:
        """Device of every canonical tensor under `device_map` (longest matching prefix)."""
        for key, device in device_map.items():
            if not (isinstance(device, int) and device >= 0) and device not in dm.OFFLOAD:
                raise ValueError(
                    f"{fn}: device_map[{key!r}]={device!r}; devices are accelerator indices "
                    '(0, 1, ...), "cpu" or "disk".'
                )
        placement: dict[str, Device] = {}
        for name in self.tensors:
            try:
                key, canonical = _unit_of(name, device_map), self.canonical[name]
            except StopIteration:
                raise ValueError(
                    f"{fn}: device_map has no entry for {name!r} (or any module above it). "
                    "Map every module, or use device_map='auto'."
                ) from None
            if placement.setdefault(canonical, device_map[key]) != device_map[key]:
                raise ValueError(
                    f"{fn}: {name!r} is tied to {canonical!r} but device_map puts them on "
                    f"{device_map[key]!r} and {placement[canonical]!r}; tied weights must share "
                    "a device."
                )
        return placement


def _checkpoint_entries(
    fn: str, checkpoint: str | os.PathLike[str]
) -> dict[str, tuple[Path, HeaderEntry]]:
    files = resolve_checkpoint(fn, checkpoint)
    entries: dict[str, tuple[Path, HeaderEntry]] = {}
    for file in files.files:
        for key, entry in read_header(file).items():
            if files.weight_map is None or files.weight_map.get(key) == file:
                entries[key] = (file, entry)
    return entries


def _check_keys(
    fn: str, layout: _Layout, entries: Mapping[str, tuple[Path, HeaderEntry]], strict: bool
) -> None:
    unexpected = sorted(k for k in entries if k not in layout.tensors)
    missing: list[str] = []
    for canonical in layout.canonical_names():
        names = layout.aliases(canonical)
        if any(n in entries for n in names):
            continue
        meta = layout.tensors[canonical].is_meta
        if meta or (strict and any(n in layout.persistent for n in names)):
            missing.append(canonical)
    if missing or (strict and unexpected):
        raise ValueError(
            f"{fn}: the checkpoint does not match the model: missing keys {missing}, unexpected "
            f"keys {unexpected if strict else []}. Load the checkpoint of this model, or pass "
            "strict=False to ignore unexpected keys and keep non-meta tensors not in the file."
        )
    for key, (file, entry) in entries.items():
        if key in layout.tensors and entry.shape != tuple(layout.tensors[key].shape):
            raise ValueError(
                f"{fn}: shape mismatch for {key!r}: the checkpoint {file.name} has "
                f"{list(entry.shape)} but the model has {list(layout.tensors[key].shape)}. "
                "Build the model with the configuration the checkpoint was saved from."
            )
        if key in layout.tensors and entry.dtype not in ST_DTYPES:
            raise NotImplementedError(f"{fn}: {key!r} has unsupported dtype {entry.dtype}.")


def _load(
    fn: str,
    layout: _Layout,
    entries: Mapping[str, tuple[Path, HeaderEntry]],
    placement: Mapping[str, Device],
    execution: torch.device,
    folder: Path | None,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor | DiskTensor]:
    """Read each shard once, putting resident tensors in place; return offloaded sources."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    done: set[str] = set()
    for key, (file, _) in entries.items():
        canonical = layout.canonical.get(key)
        if canonical is not None and canonical not in done:
            done.add(canonical)
            by_file.setdefault(file, []).append((key, canonical))
    sources: dict[str, torch.Tensor | DiskTensor] = {}
    written: dict[str, DiskTensor] = {}
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key, canonical in keys:
                device = placement[canonical]
                entry = entries[key][1]
                target = ST_DTYPES[entry.dtype][0]
                if dtype is not None and target.is_floating_point:
                    target = dtype
                if device == "disk" and target == ST_DTYPES[entry.dtype][0]:
                    where = (str(file), entry.offset, entry.shape, entry.dtype)
                    sources[canonical] = DiskTensor(*where)
                    continue
                tensor = f.get_tensor(key).to(target)
                if device == "disk":
                    if folder is None:
                        raise ValueError(
                            f"{fn}: {key!r} goes to disk as {target} (the file holds "
                            f"{entry.dtype}), which needs a copy; pass offload_dir=<folder>."
                        )
                    sources[canonical] = written[canonical] = write_tensor(folder, key, tensor)
                elif device == "cpu" and execution.type != "cpu":
                    sources[canonical] = tensor
                else:
                    _put(layout, canonical, tensor.to(_torch_device(device)))
    for canonical, device in placement.items():
        if canonical in done:
            continue
        tensor = layout.tensors[canonical]  # not in the checkpoint: a real non-persistent tensor
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if device in dm.OFFLOAD and (device == "disk" or execution.type != "cpu"):
            sources[canonical] = tensor
        else:
            _put(layout, canonical, tensor.to(_torch_device(device)))
    if written:
        assert folder is not None
        write_index(folder, written)
    return sources


def _put(layout: _Layout, canonical: str, tensor: torch.Tensor) -> None:
    """Set `tensor` under every name of the tied group `canonical` (one shared Parameter)."""
    module, attr, is_param = layout.owner[canonical]
    old = layout.tensors[canonical]
    value = nn.Parameter(tensor, old.requires_grad) if is_param else tensor
    for name in layout.aliases(canonical):
        module, attr, is_param = layout.owner[name]
        if is_param:
            module._parameters[attr] = value  # type: ignore[assignment]
        else:
            module._buffers[attr] = value


def _hook(
    model: nn.Module,
    layout: _Layout,
    device_map: Mapping[str, Device],
    sources: Mapping[str, torch.Tensor | DiskTensor],
    execution: torch.device,
) -> None:
    """Offload hooks on each unit whose tensors have sources; input moves on other GPUs."""
    modules = dict(model.named_modules())
    offloaded = [n for n in layout.tensors if layout.canonical[n] in sources]
    by_unit: dict[str, list[Slot]] = {}
    for slot, name in zip(_slots(layout, offloaded, sources), offloaded, strict=True):
        by_unit.setdefault(_unit_of(name, device_map), []).append(slot)
    for unit, device in device_map.items():
        hooked = modules[unit] if unit in modules else layout.owner[unit][0]
        if unit in by_unit:
            attach(hooked, by_unit[unit], execution)
        elif isinstance(device, int) and _torch_device(device) != execution:
            attach_input_move(hooked, _torch_device(device))


def _unit_of(name: str, device_map: Mapping[str, Device]) -> str:
    """The longest key of `device_map` that is `name` or a module above it ("" matches all)."""
    parts = name.split(".")
    keys = (".".join(parts[:i]) for i in range(len(parts), -1, -1))
    return next(k for k in keys if k in device_map)


def _hook_each_module(
    model: nn.Module,
    layout: _Layout,
    sources: Mapping[str, torch.Tensor | DiskTensor],
    device: torch.device,
) -> None:
    by_module: dict[int, tuple[nn.Module, list[Slot]]] = {}
    for slot in _slots(layout, list(layout.owner), sources):  # one pass: ties share placeholders
        by_module.setdefault(id(slot.module), (slot.module, []))[1].append(slot)
    for module, slots in by_module.values():
        attach(module, slots, device)


def _slots(
    layout: _Layout, names: Iterable[str], sources: Mapping[str, torch.Tensor | DiskTensor]
) -> list[Slot]:
    """Slots for `names`; tied names share their source and their placeholder Parameter."""
    slots: list[Slot] = []
    placeholders: dict[str, torch.Tensor] = {}
    for name in names:
        canonical = layout.canonical[name]
        module, attr, is_param = layout.owner[name]
        old = layout.tensors[name]
        source = sources[canonical]
        placeholder = placeholders.get(canonical)
        if placeholder is None:
            if isinstance(source, DiskTensor):
                dtype = ST_DTYPES[source.dtype][0]
                placeholder = torch.empty(source.shape, dtype=dtype, device="meta")
            else:
                placeholder = source
            if is_param:
                placeholder = nn.Parameter(placeholder, old.requires_grad)
            placeholders[canonical] = placeholder
        slots.append(Slot(module, attr, is_param, source, placeholder, old.requires_grad))
    return slots


def _execution_device(device_map: Mapping[str, Device]) -> torch.device:
    accelerators = [d for d in device_map.values() if isinstance(d, int)]
    return _torch_device(min(accelerators)) if accelerators else torch.device("cpu")


def _torch_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device("cpu")


def _device_arg(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _max_memory(fn: str, max_memory: Mapping[Device, int | str] | None) -> dict[Device, int]:
    """Validate budgets (ints or strings like "10GiB"); default: what this machine has free."""
    if max_memory is None:
        return _available_memory()
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(
            f"{fn}: max_memory={max_memory!r} must be a non-empty dict of device -> bytes, "
            'e.g. {0: "10GiB", "cpu": "30GiB", "disk": "1TB"}.'
        )
    budgets: dict[Device, int] = {}
    for device, budget in max_memory.items():
        if not (isinstance(device, int) and device >= 0) and device not in dm.OFFLOAD:
            raise ValueError(
                f"{fn}: max_memory key {device!r} is not a device; use accelerator indices "
                '(0, 1, ...), "cpu" or "disk".'
            )
        budgets[device] = _bytes(fn, device, budget)
    return budgets


def _bytes(fn: str, device: Device, budget: Any) -> int:
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return budget
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(budget))
    units = dict(UNITS)
    if isinstance(budget, str) and match and match.group(2).upper() in units:
        return int(float(match.group(1)) * units[match.group(2).upper()])
    raise ValueError(
        f"{fn}: max_memory[{device!r}]={budget!r} is not a size; use bytes (an int >= 0) or a "
        'string such as "500MB" or "10GiB".'
    )


def _available_memory() -> dict[Device, int]:
    budgets: dict[Device, int] = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            budgets[i] = int(torch.cuda.mem_get_info(i)[0] * 0.9)
    try:  # MemAvailable counts reclaimable page cache; the sysconf fallback counts free pages
        with open("/proc/meminfo") as f:
            lines = dict(line.split(":", 1) for line in f)
        available = int(lines["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    budgets["cpu"] = int(available * 0.9)
    return budgets
