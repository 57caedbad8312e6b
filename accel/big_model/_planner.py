"""Device maps by Accelerate's rules (`infer_auto_device_map`, `get_balanced_memory`), pure.

Nothing here touches a device: sizes come from shapes and dtypes (meta tensors work), and the
plan works with any budgets, whether or not those devices exist on this machine.

The rules, in the order the planner applies them:
- devices fill in order: accelerators by index, "cpu", then "disk" (always there, unlimited);
- the first accelerator and "cpu" keep room for the largest layer still to place (a layer: a
  module without children, or of a no-split class), since offloaded layers run there;
- a module that does not fit is split into its own tensors and children (a no-split class
  never is); one that cannot be split sends planning on to the next device;
- a module is placed together with the modules holding the other names of its tied tensors,
  splitting those modules first if that makes the group fit;
- finally, children that all landed on one device are merged back under their parent's name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

Device = int | str
"""A device-map value: an accelerator index, "cpu" or "disk"."""

Item = tuple[str, nn.Module | torch.Tensor]
"""A name awaiting placement and what it names: a module, or a tensor of a split module."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def tensor_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of `t`, as `dtype` when given and `t` is floating point."""
    itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
    return t.numel() * itemsize


def sizes(model: nn.Module, dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes under every tensor name and every module prefix of one ("" is the whole model).

    Parameters come first, then buffers; a tied tensor counts at its first name only (its other
    names are absent, i.e. 0), as in Accelerate's `compute_module_sizes`.
    """
    out: dict[str, int] = {}
    named = [*model.named_parameters(), *model.named_buffers()]  # each tensor once
    for name, t in named:
        nbytes = tensor_nbytes(t, dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            out[key] = out.get(key, 0) + nbytes
    return out


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one tensor, for every tensor reachable under more than one name."""
    by_id: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                by_id.setdefault(id(t), []).append(_join(prefix, attr))
    return [names for names in by_id.values() if len(names) > 1]


def _children(item: Item, no_split: frozenset[str], *, with_tensors: bool) -> list[Item]:
    """What `item` splits into: nothing for a tensor, a module without children or a no-split
    class; else its children (and, `with_tensors`, its own parameters first, buffers last)."""
    name, obj = item
    if not isinstance(obj, nn.Module) or type(obj).__name__ in no_split:
        return []
    kids: list[Item] = [(_join(name, n), m) for n, m in obj.named_children()]
    if not kids or not with_tensors:
        return kids
    params: list[Item] = [(_join(name, n), p) for n, p in obj.named_parameters(recurse=False)]
    buffers: list[Item] = [(_join(name, n), b) for n, b in obj.named_buffers(recurse=False)]
    return params + kids + buffers


def _largest_layer(
    items: Iterable[Item], size: Mapping[str, int], no_split: frozenset[str]
) -> tuple[int, list[str]]:
    """The size of the largest layer under `items`, and the names of the layers that size."""
    largest, names = 0, []
    todo = list(items)
    while todo:
        item = todo.pop(0)
        kids = _children(item, no_split, with_tensors=False)
        if kids:
            todo = kids + todo
            continue
        nbytes = size.get(item[0], 0)
        if nbytes > largest:
            largest, names = nbytes, [item[0]]
        elif nbytes == largest:
            names.append(item[0])
    return largest, names


def _inside(name: str, inner: str) -> bool:
    return f"{inner}.".startswith(f"{name}.") if name else True


def _tied_elsewhere(name: str, ties: list[list[str]]) -> list[str]:
    """Names outside `name` that share a tensor with a name inside it."""
    out: list[str] = []
    for group in ties:
        inside = [_inside(name, n) for n in group]
        if any(inside) and not all(inside):
            out += [n for n, i in zip(group, inside, strict=True) if not i]
    return out


def _holder(tensor: str, todo: list[Item]) -> int | None:
    """Index in `todo` of the item that is `tensor` or holds it."""
    return next((i for i, (n, _) in enumerate(todo) if _inside(n, tensor)), None)


def plan(
    model: nn.Module,
    budgets: Mapping[Device, int],
    no_split: frozenset[str],
    dtype: torch.dtype | None,
) -> dict[str, Device]:
    """The device map of `model` under `budgets` (ints, already validated), by the rules above.

    The loop is Accelerate's greedy walk; it is one function because its state (the queue,
    the largest layer still to place, the device in use) changes together at every step.
    """
    size = sizes(model, dtype)
    ties = tied_groups(model)
    devices = ordered_devices(budgets)
    accelerators = [d for d in devices if isinstance(d, int)]
    reserving = {accelerators[0], "cpu"} if accelerators else {"cpu"}
    todo: list[Item] = _children(("", model), frozenset(), with_tensors=True) or [
        (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    largest, largest_names = _largest_layer(todo, size, no_split)
    used = dict.fromkeys(devices, 0)
    placed: dict[str, Device] = {}
    index = 0
    while todo:
        name, obj = todo.pop(0)
        largest_names = [n for n in largest_names if not _inside(name, n)]
        if not largest_names:
            largest, largest_names = _largest_layer(_modules(todo), size, no_split)
        device = devices[index]
        room = None
        if device != "disk":
            room = budgets[device] - used[device] - (largest if device in reserving else 0)
        nbytes = size.get(name, 0)
        elsewhere = _tied_elsewhere(name, ties)
        holders = [_holder(t, todo) for t in elsewhere]
        with_ties = nbytes + sum(
            size.get(todo[h][0], 0) - size.get(t, 0)
            for t, h in zip(elsewhere, holders, strict=True)
            if h is not None
        )
        if room is None or with_ties <= room:
            used[device] += with_ties
            placed[name] = device
            tied = list(dict.fromkeys(todo[h][0] for h in holders if h is not None))
            placed.update(dict.fromkeys(tied, device))
            todo = [i for i in todo if i[0] not in tied]
            continue
        if elsewhere and nbytes <= room:  # it fits alone: split a tied module to fit with it
            split = next((h for h in holders if h is not None and _split(todo[h], no_split)), None)
            if split is not None:
                todo = todo[:split] + _split(todo[split], no_split) + todo[split + 1 :]
                todo.insert(0, (name, obj))
                largest, largest_names = _largest_layer(_modules(todo), size, no_split)
                continue
        if nbytes >= room and _split((name, obj), no_split):
            todo = _split((name, obj), no_split) + todo
            largest, largest_names = _largest_layer(_modules(todo), size, no_split)
            continue
        index += 1
        todo.insert(0, (name, obj))
    return merge_children(placed)


def _modules(items: list[Item]) -> list[Item]:
    return [i for i in items if isinstance(i[1], nn.Module)]


def _split(item: Item, no_split: frozenset[str]) -> list[Item]:
    return _children(item, no_split, with_tensors=True)


def execution_index(device_map: Mapping[str, Device], budgets: Mapping[Device, int]) -> Device:
    """Where the modules on "cpu" and "disk" run: the first accelerator of the map, else the
    first the budgets give memory to (a model too large for its accelerator's budget, all of
    it offloaded, still runs there, as the budget said it should), else "cpu"."""
    in_map = [d for d in device_map.values() if isinstance(d, int)]
    budgeted = [d for d, b in budgets.items() if isinstance(d, int) and b > 0]
    accelerators = in_map or budgeted
    return min(accelerators) if accelerators else "cpu"


def ordered_devices(budgets: Mapping[Device, int]) -> list[Device]:
    """Accelerators by index, then "cpu" (when budgeted), then "disk" (always)."""
    accelerators = sorted(d for d in budgets if isinstance(d, int))
    return [*accelerators, *(["cpu"] if "cpu" in budgets else []), "disk"]


def merge_children(device_map: Mapping[str, Device], name: str = "") -> dict[str, Device]:
    """Replace the entries under a module by the module's name when they share one device,
    from the root down (Accelerate's `clean_device_map`); the order of entries is kept."""
    out = dict(device_map)
    prefix = f"{name}." if name else ""
    under = [k for k in out if k.startswith(prefix)]
    if len(under) > 1 and len({out[k] for k in under}) == 1:
        first = under[0]
        return {
            (name if k == first else k): v for k, v in out.items() if k == first or k not in under
        }
    depth = name.count(".") + 2 if name else 1
    for child in dict.fromkeys(".".join(k.split(".")[:depth]) for k in under if len(k) > len(name)):
        out = merge_children(out, child)
    return out


def balanced_budgets(
    model: nn.Module,
    budgets: Mapping[Device, int],
    no_split: frozenset[str],
    dtype: torch.dtype | None,
    *,
    low_zero: bool,
) -> dict[Device, int]:
    """Budgets that spread the model evenly over the accelerators (Accelerate's
    `get_balanced_memory`): each but the last gets its share of the model plus 1.25 times the
    larger of the first no-split block and the mean final module; with `low_zero` the first
    gets only what the others cannot hold."""
    out = dict(budgets)
    gpus = sorted(d for d, b in out.items() if isinstance(d, int) and b > 0)
    if not gpus:
        return out
    low_zero = low_zero and len(gpus) > 1
    size = sizes(model, dtype)
    share = size.get("", 0) // (len(gpus) - 1 if low_zero else len(gpus))
    modules = dict(model.named_modules())
    firsts: dict[str, int] = {}
    for name, nbytes in size.items():
        cls = type(modules[name]).__name__ if name and name in modules else ""
        if cls in no_split:
            firsts.setdefault(cls, nbytes)
    block = max(firsts.values(), default=0)
    inner = {n: s for n, s in size.items() if n not in _leaves(size)}
    finals = _leaves(inner)
    mean = int(sum(inner[n] for n in finals) / max(len(finals), 1))
    share += int(1.25 * max(block, mean))
    for d in gpus[:-1]:
        out[d] = min(out[0] if low_zero and d == 0 else share, out[d])
    if low_zero and 0 in out:
        others = sum(out.get(i, 0) for i in range(1, len(gpus)))
        out[0] = min(max(0, size.get("", 0) - others), out[0])
    return out


def _leaves(size: Mapping[str, int]) -> list[str]:
    """Names in `size` that no other name in it extends (Accelerate's `get_module_leaves`)."""
    parents = {n.rsplit(".", 1)[0] for n in size if "." in n}
    return [n for n in size if n and n not in parents]
