"""The effectful half of dispatch_checkpoint: where each tensor of a model is held, reading the
checkpoint shard by shard into place, and hooking offloaded units."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from accel._safetensors.files import resolve_checkpoint, verified_headers
from accel._store.exports import fetch_export
from accel._store.staging import named_as, transfer_folder
from accel._store.urls import Remote, locate
from accel.big_model import _device_map as dm
from accel.big_model._hooks import ATTR, Slot, attach, attach_input_move
from accel.big_model._offload import (
    ST_DTYPES,
    DiskTensor,
    HeaderEntry,
    write_index,
    write_tensor,
)
from accel.big_model._planner import Device, execution_index


def check_unhooked(fn: str, model: nn.Module) -> None:
    """Refuse a model that already carries offload hooks (they would stack)."""
    if any(hasattr(m, ATTR) for m in model.modules()):
        raise RuntimeError(
            f"{fn}: the model already has accel offload hooks (from dispatch_checkpoint, "
            "cpu_offload or disk_offload). Call accel.remove_hooks(model) first."
        )


class Layout:
    """Where each tensor of a model is held: every name, its owner, tied aliases."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.owner: dict[str, tuple[nn.Module, str, bool]] = {}
        self.canonical: dict[str, str] = {}
        self.persistent: set[str] = set()
        self.groups: dict[str, list[str]] = {}  # canonical name -> every name of that tensor
        first: dict[int, str] = {}
        self.modules = list(model.named_modules())
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
                self.groups.setdefault(self.canonical[name], []).append(name)
                if is_param or attr not in module._non_persistent_buffers_set:
                    self.persistent.add(name)

    def canonical_names(self) -> list[str]:
        return list(self.groups)

    def aliases(self, canonical: str) -> list[str]:
        return self.groups[canonical]

    def place(self, fn: str, device_map: Mapping[str, Device]) -> dict[str, Device]:
        """Device of every canonical tensor under `device_map` (longest matching prefix)."""
        for key, device in device_map.items():
            if not (isinstance(device, int) and device >= 0) and device not in dm.OFFLOAD:
                raise ValueError(
                    f"{fn}: device_map[{key!r}]={device!r}; devices are accelerator indices "
                    '(0, 1, ...), "cpu" or "disk".'
                )
        modules = {name for name, _ in self.modules}
        unknown = [k for k in device_map if k not in modules and k not in self.tensors]
        if unknown:
            raise ValueError(
                f"{fn}: device_map names {unknown}, which are neither modules nor tensors of the "
                "model. Use names from model.named_modules() or model.named_parameters()."
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


@contextmanager
def local_files(
    fn: str, checkpoint: str | os.PathLike[str], offload: Path | None
) -> Iterator[tuple[str | os.PathLike[str], bool]]:
    """The checkpoint as local files, and whether weights may stay on "disk" reading them.

    A local path is itself. A URL is downloaded (each file checked against the manifest beside
    it): into `offload`/checkpoint when given, kept there for the weights placed on "disk";
    otherwise into a temporary folder removed when the block ends, so no weight may stay on
    "disk" (`check_disk`). Errors naming the download name the URL.
    """
    where = locate(fn, "checkpoint", checkpoint)
    if not isinstance(where, Remote):
        yield where, True
        return
    if offload is not None:
        kept = offload / "checkpoint"
        kept.mkdir(exist_ok=True)
        with named_as(kept, where.url):
            yield fetch_export(fn, where, kept), True
        return
    with transfer_folder("download") as scratch, named_as(scratch, where.url):
        yield fetch_export(fn, where, scratch), False


def check_disk(fn: str, placement: Mapping[str, Device], disk_ok: bool) -> None:
    """Refuse "disk" placements reading downloaded files that go when the call returns."""
    on_disk = sorted(name for name, device in placement.items() if device == "disk")
    if on_disk and not disk_ok:
        raise ValueError(
            f"{fn}: device_map places {on_disk[:3]} ({len(on_disk)}) on 'disk', whose weights "
            "are read from the checkpoint's files while the model runs, but the checkpoint is "
            "in a store and its downloaded files go once the call returns. Pass offload_dir= "
            "to keep them there."
        )


def checkpoint_entries(
    fn: str, checkpoint: str | os.PathLike[str]
) -> dict[str, tuple[Path, HeaderEntry]]:
    files = resolve_checkpoint(fn, checkpoint)
    entries: dict[str, tuple[Path, HeaderEntry]] = {}
    # The shared parser: bounded, validated headers; sizes and crc32 when a manifest is there.
    for file, header in verified_headers(fn, files).items():
        for key, t in header.tensors.items():
            if files.weight_map is None or files.weight_map.get(key) == file:
                entries[key] = (file, HeaderEntry(t.dtype, t.shape, header.data_start + t.begin))
    return entries


def check_keys(
    fn: str, layout: Layout, entries: Mapping[str, tuple[Path, HeaderEntry]], strict: bool
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


def load(
    fn: str,
    layout: Layout,
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
                if target == ST_DTYPES[entry.dtype][0]:
                    tensor = f.get_tensor(key)
                else:  # cast while reading: never the whole source beside its copy
                    tensor = DiskTensor(str(file), entry.offset, entry.shape, entry.dtype).read_as(
                        target
                    )
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
        # Not in the checkpoint: a real non-persistent tensor (a rotary table), kept as the
        # model built it; `dtype` casts the checkpoint's tensors only.
        tensor = layout.tensors[canonical]
        if device in dm.OFFLOAD and (device == "disk" or execution.type != "cpu"):
            sources[canonical] = tensor
        else:
            _put(layout, canonical, tensor.to(_torch_device(device)))
    if written:
        assert folder is not None
        write_index(folder, written)
    return sources


def _put(layout: Layout, canonical: str, tensor: torch.Tensor) -> None:
    """Set `tensor` under every name of the tied group `canonical` (one shared Parameter)."""
    is_param = layout.owner[canonical][2]
    old = layout.tensors[canonical]
    value = nn.Parameter(tensor, old.requires_grad) if is_param else tensor
    for name in layout.aliases(canonical):
        module, attr, is_param = layout.owner[name]
        if is_param:
            module._parameters[attr] = value  # type: ignore[assignment]
        else:
            module._buffers[attr] = value


def hook(
    model: nn.Module,
    layout: Layout,
    device_map: Mapping[str, Device],
    sources: Mapping[str, torch.Tensor | DiskTensor],
    execution: torch.device,
    layers: frozenset[str] | None = None,
) -> None:
    """Offload hooks on each unit whose tensors have sources; input moves on other GPUs.

    A unit that is never called itself (an `nn.ModuleList`: no forward of its own) is hooked
    through the modules under it that are called, each for the tensors under it. With
    `layers` (the no-split class names of a planned map), an offloaded unit is hooked layer by
    layer instead: each no-split module under it whole, and each other module for its own
    tensors, so the execution device holds one layer's weights at a time whatever the planner
    merged (a map of `{"": "cpu"}` would otherwise bring the whole model there at once).
    """
    modules = dict(model.named_modules())
    offloaded = [n for n in layout.tensors if layout.canonical[n] in sources]
    by_target: dict[str, list[Slot]] = {}
    for slot, name in zip(_slots(layout, offloaded, sources), offloaded, strict=True):
        unit = _unit_of(name, device_map)
        target = _called_unit(name, unit, modules)
        if layers is not None:
            layer = _layer_under(name, unit, modules, layers)
            target = layer if layer not in modules or _runs_itself(modules[layer]) else target
        by_target.setdefault(target, []).append(slot)
    for target, slots in by_target.items():
        attach(modules[target] if target in modules else layout.owner[target][0], slots, execution)
    for unit, device in device_map.items():
        if not isinstance(device, int) or _torch_device(device) == execution:
            continue
        for target in _called_units(unit, modules) if unit in modules else [unit]:
            if target not in by_target:
                hooked = modules[target] if target in modules else layout.owner[target][0]
                attach_input_move(hooked, _torch_device(device))


def _runs_itself(module: nn.Module) -> bool:
    """Whether calling `module` does anything: containers have no forward of their own."""
    return type(module).forward is not nn.Module.forward


def _called_unit(name: str, unit: str, modules: Mapping[str, nn.Module]) -> str:
    """`unit`, or, when it never runs itself, the module under it, above `name`, that runs."""
    target = unit
    parts = name.split(".")
    depth = len(unit.split(".")) if unit else 0
    while target in modules and not _runs_itself(modules[target]) and depth < len(parts) - 1:
        depth += 1
        target = ".".join(parts[:depth])
    return target


def _layer_under(
    name: str, unit: str, modules: Mapping[str, nn.Module], layers: frozenset[str]
) -> str:
    """The module that brings tensor `name` of `unit` in: the first module from `unit` down
    to the tensor whose class is in `layers` (never split), else the tensor's own module."""
    parts = name.split(".")
    depth = len(unit.split(".")) if unit else 0
    target = unit
    while depth < len(parts) - 1 and not (
        target in modules and type(modules[target]).__name__ in layers
    ):
        depth += 1
        target = ".".join(parts[:depth])
    return target


def _called_units(unit: str, modules: Mapping[str, nn.Module]) -> list[str]:
    """The modules at or under `unit` that run: `unit`, or the children of a container."""
    if _runs_itself(modules[unit]):
        return [unit]
    dot = f"{unit}." if unit else ""
    kids = [dot + n for n, m in modules[unit].named_children()]
    return [t for kid in kids for t in _called_units(kid, modules)]


def _unit_of(name: str, device_map: Mapping[str, Device]) -> str:
    """The longest key of `device_map` that is `name` or a module above it ("" matches all)."""
    parts = name.split(".")
    keys = (".".join(parts[:i]) for i in range(len(parts), -1, -1))
    return next(k for k in keys if k in device_map)


def hook_each_module(
    model: nn.Module,
    layout: Layout,
    sources: Mapping[str, torch.Tensor | DiskTensor],
    device: torch.device,
) -> None:
    by_module: dict[int, tuple[nn.Module, list[Slot]]] = {}
    for slot in _slots(layout, list(layout.owner), sources):  # one pass: ties share placeholders
        by_module.setdefault(id(slot.module), (slot.module, []))[1].append(slot)
    for module, slots in by_module.values():
        attach(module, slots, device)


def _slots(
    layout: Layout, names: Iterable[str], sources: Mapping[str, torch.Tensor | DiskTensor]
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


def execution_device(
    device_map: Mapping[str, Device], budgets: Mapping[Device, int] | None = None
) -> torch.device:
    """The device offloaded modules run on (`_planner.execution_index`): with `budgets` (a
    planned map), an accelerator given memory counts even when no module fitted on it."""
    used = sorted({d for d in device_map.values() if isinstance(d, int)})
    runs = execution_index(device_map, budgets or {})
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in used if d >= count]
    if missing:
        raise ValueError(
            f"dispatch_checkpoint: the device map puts modules on accelerators {missing} but "
            f"this machine has {count} CUDA device(s). Plan with the budgets of this machine "
            '(max_memory=None), or map those modules to "cpu" or "disk".'
        )
    if isinstance(runs, int) and runs >= count:
        raise ValueError(
            f"dispatch_checkpoint: max_memory gives accelerator {runs} memory, so the offloaded "
            f"modules would run there, but this machine has {count} CUDA device(s). Plan with "
            "the budgets of this machine (max_memory=None), or drop it from max_memory."
        )
    return _torch_device(runs)


def _torch_device(device: Device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device("cpu")


def device_arg(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
