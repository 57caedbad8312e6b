"""Big models: build empty, plan a device map, stream a checkpoint in, offload the rest.

A model larger than any one device is built on the meta device (`init_empty_weights`), planned
(`infer_device_map`, pure: any `max_memory` works without those devices present), and loaded
shard by shard (`dispatch_checkpoint`). Modules mapped to "cpu" or "disk" run through hooks
(accel.big_model._hooks) that bring their weights to the execution device only for their forward.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal, get_args

import torch
from torch import nn

from accel._typing import as_dtype
from accel.big_model import _device_map as dm
from accel.big_model import _planner, _table
from accel.big_model._hooks import remove_hooks
from accel.big_model._offload import DiskTensor, check_writable, write_index, write_tensor
from accel.big_model._planner import Device

__all__ = [
    "compute_module_sizes",
    "cpu_offload",
    "describe_device_map",
    "disk_offload",
    "dispatch_checkpoint",
    "infer_device_map",
    "init_empty_weights",
    "init_on_device",
    "remove_hooks",
]


@contextmanager
def init_on_device(device: torch.device | str, *, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter (and buffer, if asked) built inside the block on `device`.

    On "meta" nothing is allocated: shapes and dtypes only. Buffers stay on the CPU by default
    because many are computed at build time (rotary tables) and are not in checkpoints.
    The block patches `nn.Module.register_parameter` (and `register_buffer`) for its duration;
    build models in it from one thread at a time.

    Args:
        device: where new parameters go, a `torch.device` or a string such as "meta" or
            "cuda:0".
        include_buffers: move buffers registered inside the block to `device` too; default
            False (they stay where they were created, usually the CPU).

    Yields:
        None; build the model inside the block.

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
def init_empty_weights(*, include_buffers: bool = False) -> Iterator[None]:
    """Build a model with no memory: parameters created inside the block live on "meta".

    Fill it afterwards with `dispatch_checkpoint` (or `load_state_dict(..., assign=True)`).
    The same as `init_on_device("meta", include_buffers=include_buffers)`.

    Args:
        include_buffers: put buffers registered inside the block on "meta" too; default False
            (they stay on the CPU, where computed buffers such as rotary tables are needed).

    Yields:
        None; build the model inside the block.

    Example:
        >>> import torch, accel
        >>> with accel.init_empty_weights():
        ...     model = torch.nn.Sequential(*[torch.nn.Linear(10_000, 10_000) for _ in range(100)])
        >>> sum(p.numel() for p in model.parameters())
        10001000000
    """
    with init_on_device("meta", include_buffers=include_buffers):
        yield


def compute_module_sizes(
    model: nn.Module, *, dtype: torch.dtype | str | None = None
) -> dict[str, int]:
    """Return the bytes of parameters and buffers under each module name ("" is the model).

    A tied tensor counts once (at its first name); with `dtype` (a torch dtype or its name),
    floating-point tensors are counted at that dtype's size (integer buffers keep theirs).
    Works on meta models.

    Args:
        model: the model to measure, on any device including "meta".
        dtype: count floating-point tensors at this dtype's element size; default None, their
            own dtype.

    Returns:
        Module name -> size in bytes of every parameter and buffer under it; "" is the whole
        model.

    Example:
        >>> import torch, accel
        >>> accel.compute_module_sizes(torch.nn.Linear(4, 2), dtype="float16")
        {'': 20}
    """
    # Any dtype sizes (int8 estimates a quantized load, as in Accelerate).
    return dm.module_sizes(model, as_dtype("compute_module_sizes", "dtype", dtype, floating=False))


DeviceMapStrategy = Literal["sequential", "balanced", "balanced_low_0"]


def infer_device_map(
    model: nn.Module,
    *,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split: Iterable[str | type] = (),
    dtype: torch.dtype | str | None = None,
    strategy: DeviceMapStrategy = "sequential",
) -> dict[str, Device]:
    """Plan where each module lives, by the rules of Accelerate's `infer_auto_device_map`.

    Modules fill accelerator 0, 1, ..., then "cpu", then "disk" (always available, unlimited),
    in module order. The first accelerator and the CPU keep room for the largest layer still to
    place, since offloaded layers run there. A module that does not fit is split into its own
    tensors and children, unless its class is in `no_split`. Modules sharing tied tensors are
    placed together. Children that land on one device are merged back under their parent's
    name. "balanced" and "balanced_low_0" first lower each accelerator's budget but the last to
    an even share of the model (Accelerate's `get_balanced_memory`; "balanced_low_0" keeps
    accelerator 0 as empty as it can). Pure: nothing is allocated, no device needs to exist.

    Args:
        model: the model (usually built under `init_empty_weights`).
        max_memory: bytes per device, e.g. `{0: "10GiB", "cpu": 2**34}`; size strings parse
            as in Accelerate ("MB" is 10**6 bytes, "MiB" 2**20, a lowercase "b" bits). Without
            a "cpu" entry, 80% of the available RAM. Default: the free memory of each CUDA
            device and 90% of the available RAM.
        no_split: classes (or class names) never split across devices (residual blocks).
        dtype: size floating-point tensors as this dtype (a torch dtype or its name).
        strategy: "sequential", "balanced" or "balanced_low_0".

    Returns:
        Module or tensor name -> device (an accelerator index, "cpu" or "disk"), in module order.

    Raises:
        ValueError: a bad `max_memory`, `dtype` name or `strategy`.
        TypeError: a `dtype` that is neither a torch dtype nor a string.

    Example:
        >>> import torch, accel
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(5)])  # 80 B each
        >>> accel.infer_device_map(model, max_memory={0: 250, "cpu": 170})
        {'0': 0, '1': 0, '2': 'cpu', '3': 'disk', '4': 'disk'}
    """
    fn = "infer_device_map"
    if strategy not in get_args(DeviceMapStrategy):
        raise ValueError(
            f"{fn}: strategy={strategy!r} is not a strategy; expected one of "
            f"{get_args(DeviceMapStrategy)}. Use 'balanced' to spread a model over several GPUs."
        )
    budgets = dm.budgets(fn, max_memory)
    names = frozenset(c if isinstance(c, str) else c.__name__ for c in no_split)
    torch_dtype = as_dtype(fn, "dtype", dtype, floating=False)
    if strategy != "sequential":
        low_zero = strategy == "balanced_low_0"
        budgets = _planner.balanced_budgets(model, budgets, names, torch_dtype, low_zero=low_zero)
    return _planner.plan(model, budgets, names, torch_dtype)


def dispatch_checkpoint(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: Literal["auto"] | DeviceMapStrategy | Mapping[str, Device] = "auto",
    max_memory: Mapping[Device, int | str] | None = None,
    no_split: Iterable[str | type] = (),
    offload_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
) -> nn.Module:
    """Load a safetensors checkpoint into an empty model shard by shard, placing each module.

    Each shard is opened once and its tensors go straight into place (no full state dict).
    Modules on "cpu" (when an accelerator runs the model) or "disk" get hooks that bring their
    weights to the execution device for their forward: the first accelerator of the map, or,
    for a planned map, of the budgets (a model whose every module was offloaded still runs on
    the accelerator `max_memory` names). A planned map's offloaded modules are hooked layer by
    layer (each `no_split` module whole), so that device holds one layer at a time. Tied
    weights are placed together. Disk weights are mapped in place from
    the safetensors file when possible, else written to `offload_dir` as numpy memmaps.
    CPU weights in the file's dtype stay memory-mapped from the shards (as safetensors returns
    them), so do not overwrite the checkpoint in place while the model is in use.

    Args:
        model: a model built under `init_empty_weights` (or a real one, overwritten).
        checkpoint: a .safetensors file, a sharded index .json, or a folder holding either; or
            the URL of one in a store (s3://, gs://: downloaded first, into `offload_dir` when
            given, which weights placed on "disk" then read).
        device_map: a strategy of `infer_device_map` ("sequential", "balanced",
            "balanced_low_0"; "auto" is "balanced", as in Accelerate), or module/tensor name ->
            device. Any module may be named, containers never called themselves (an
            `nn.ModuleList`) included: the modules under them that run are hooked.
        max_memory: budgets for planning (see `infer_device_map`); "disk" is always there.
        no_split: classes (or names) never split across devices.
        offload_dir: folder for disk-offloaded weights that must be rewritten (dtype change).
        dtype: cast the checkpoint's floating-point tensors to this dtype (or its name) while
            loading; buffers the checkpoint does not hold stay as the model built them.
        strict: refuse checkpoints with missing or unexpected keys (missing keys that would
            leave a meta tensor are refused either way).

    Returns:
        The same model, loaded and dispatched, with the map used in `model.hf_device_map`.
        Use `remove_hooks` to drop the hooks.

    Raises:
        ValueError: missing/unexpected keys, a shape mismatch, a device map that misses a
            tensor or splits tied weights, an unwritable `offload_dir`, a bad `max_memory`,
            `dtype` or strategy, or a dtype change on disk without `offload_dir`.
        FileNotFoundError: the checkpoint or a shard does not exist.
        RuntimeError: the model already has offload hooks (call `remove_hooks` first).
        TypeError: a `device_map` that is neither a strategy nor a mapping, or a `dtype`
            that is neither a torch dtype nor a string.

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
    from accel.big_model import _dispatch  # imported on use, to keep `import accel` light

    fn = "dispatch_checkpoint"
    _dispatch.check_unhooked(fn, model)
    torch_dtype = as_dtype(fn, "dtype", dtype)  # a cast target: floating only
    folder = check_writable(fn, offload_dir) if offload_dir is not None else None
    # A URL is downloaded first (its "disk" weights then need offload_dir to stay readable).
    with _dispatch.local_files(fn, checkpoint, folder) as (local, disk_ok):
        entries = _dispatch.checkpoint_entries(fn, local)
        layout = _dispatch.Layout(model)
        _dispatch.check_keys(fn, layout, entries, strict)
        budgets: dict[Device, int] | None = None  # a planned map's: where offloaded modules run
        layers: frozenset[str] | None = None  # a planned map's: offloaded modules hook per layer
        if isinstance(device_map, str):
            strategy = "balanced" if device_map == "auto" else device_map
            if strategy not in get_args(DeviceMapStrategy):
                raise ValueError(
                    f"{fn}: device_map={device_map!r} is neither a strategy nor a dict; expected "
                    f"'auto' or one of {get_args(DeviceMapStrategy)}, or a dict of name -> device."
                )
            budgets = dm.budgets(fn, max_memory)
            layers = frozenset(c if isinstance(c, str) else c.__name__ for c in no_split)
            device_map = infer_device_map(
                model, max_memory=budgets, no_split=layers, dtype=torch_dtype, strategy=strategy
            )
        elif not isinstance(device_map, Mapping):
            raise TypeError(
                f"{fn}: device_map={device_map!r} must be 'auto' or a dict of name -> device."
            )
        elif max_memory is not None or no_split:
            warnings.warn(
                f"{fn}: max_memory and no_split only shape a planned device_map; they are ignored "
                "with the device_map you passed.",
                stacklevel=2,
            )
        placement = layout.place(fn, device_map)
        _dispatch.check_disk(fn, placement, disk_ok)
        execution = _dispatch.execution_device(device_map, budgets)
        sources = _dispatch.load(fn, layout, entries, placement, execution, folder, torch_dtype)
        _dispatch.hook(model, layout, device_map, sources, execution, layers)
        object.__setattr__(model, "hf_device_map", dict(device_map))  # as transformers names it
        return model


def describe_device_map(
    model: nn.Module,
    *,
    device_map: Mapping[str, Device] | None = None,
    max_memory: Mapping[Device, int | str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Return a device map as a Markdown table per device: modules, bytes, share of the budget.

    Args:
        model: the model the map places (its tensors give the bytes; meta tensors count).
        device_map: default `model.hf_device_map`, the map `dispatch_checkpoint` chose.
        max_memory: the budgets to compare with, as `infer_device_map` takes them; default what
            this machine has free (the budgets a plan without `max_memory` gets).
        dtype: count floating-point tensors at this dtype, as the plan did when given one.

    Returns:
        One row per device (accelerators, "cpu", "disk"), each with its module count and names,
        their bytes, and that as a share of the device's budget ("no limit" for the disk).

    Raises:
        ValueError: the model has no `hf_device_map` and none is given; a bad `max_memory`.

    Example:
        >>> import torch, accel
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])  # 80 B each
        >>> placed = {"0": "cpu", "1": "cpu", "2": "disk"}
        >>> print(accel.describe_device_map(model, device_map=placed, max_memory={"cpu": 320}))
        | device | modules | bytes | share of budget |
        |---|---|---|---|
        | cpu | 2: 0, 1 | 160 B | 50.0% of 320 B |
        | disk | 1: 2 | 80 B | no limit |
    """
    fn = "describe_device_map"
    chosen = device_map if device_map is not None else getattr(model, "hf_device_map", None)
    if not isinstance(chosen, Mapping):
        raise ValueError(
            f"{fn}: device_map=None and the model has no hf_device_map; pass "
            "device_map=infer_device_map(model, ...), or call dispatch_checkpoint first."
        )
    sizes = _planner.sizes(model, as_dtype(fn, "dtype", dtype, floating=False))
    return _table.render(chosen, sizes, dm.budgets(fn, max_memory))


def cpu_offload(
    model: nn.Module, *, execution_device: torch.device | str | int | None = None
) -> nn.Module:
    """Keep `model`'s weights on the CPU, moving each module's to the execution device per forward.

    Each module's weights go to `execution_device` only for its forward.

    Args:
        model: a model in memory.
        execution_device: where forwards run (an int is a CUDA index); default the current
            CUDA device, else the CPU.

    Returns:
        The same model, hooked (undo with `remove_hooks`).

    Raises:
        RuntimeError: when the model already has offload hooks (call `remove_hooks` first).

    Example:
        >>> import torch, accel
        >>> model = accel.cpu_offload(torch.nn.Linear(2, 2), execution_device="cpu")
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    from accel.big_model import _dispatch  # imported on use, to keep `import accel` light

    _dispatch.check_unhooked("cpu_offload", model)
    device = _dispatch.device_arg(execution_device)
    layout = _dispatch.Layout(model)
    sources: dict[str, torch.Tensor | DiskTensor] = {
        n: layout.tensors[n].detach().cpu() for n in layout.canonical_names()
    }
    _dispatch.hook_each_module(model, layout, sources, device)
    return model


def disk_offload(
    model: nn.Module,
    *,
    offload_dir: str | os.PathLike[str],
    execution_device: torch.device | str | int | None = None,
) -> nn.Module:
    """Write `model`'s weights to `offload_dir` as numpy memmaps and read them back per forward.

    Each module's weights are read back lazily, only for its forward.

    Args:
        model: a model in memory (its tensors are replaced by meta placeholders).
        offload_dir: a writable folder; it receives one `.dat` per tensor and `index.json`.
        execution_device: where forwards run (an int is a CUDA index); default the current
            CUDA device, else the CPU.

    Returns:
        The same model, hooked (undo with `remove_hooks`).

    Raises:
        RuntimeError: when the model already has offload hooks (call `remove_hooks` first).
        ValueError: when `offload_dir` cannot be created or written to.

    Example:
        >>> import tempfile, torch, accel
        >>> model = accel.disk_offload(torch.nn.Linear(2, 2), offload_dir=tempfile.mkdtemp())
        >>> model.weight.device
        device(type='meta')
    """
    from accel.big_model import _dispatch  # imported on use, to keep `import accel` light

    _dispatch.check_unhooked("disk_offload", model)
    folder = check_writable("disk_offload", offload_dir)
    device = _dispatch.device_arg(execution_device)
    layout = _dispatch.Layout(model)
    sources: dict[str, torch.Tensor | DiskTensor] = {
        n: write_tensor(folder, n, layout.tensors[n]) for n in layout.canonical_names()
    }
    write_index(folder, {n: s for n, s in sources.items() if isinstance(s, DiskTensor)})
    _dispatch.hook_each_module(model, layout, sources, device)
    return model
