"""Cut a model into pipeline stages: the pure split arithmetic and the stage modules.

A model is seen as an ordered list of units: its children in registration order, with the
container of repeated blocks (an nn.ModuleList or nn.ModuleDict whose members share one class,
e.g. `layers`) opened into its blocks (`layers.0`, `layers.1`, ...) and any module above it
opened on the way. A stage is a run of consecutive units. Its module is a skeleton of the model
that shares the kept units (no tensor is copied) and holds `nn.Identity` in place of the units
of other stages, so a forward that applies its modules in order runs unchanged on every stage
(the first stage's embedding output is what the second stage's Identity embedding passes on).
Blocks keep their names (`layers.5` stays `layers.5` on the stage holding it), so state dicts
and checkpoints use the fully qualified names of the whole model. Units without parameters
(rotary tables, dropout) stay on every stage.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from torch import nn


def _is_blocks(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
        return False
    return len({type(m) for m in module.children()}) == 1


def blocks_container(model: nn.Module) -> str | None:
    """The name of the first container of repeated blocks (None when the model has none)."""
    return next((name for name, m in model.named_modules() if name and _is_blocks(m)), None)


def units(model: nn.Module) -> list[str]:
    """The model's units in order: its children, the blocks container opened into its blocks.

    Example:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> units(m)
        ['0', '1.0', '1.1']
    """
    container = blocks_container(model)

    def walk(module: nn.Module, prefix: str) -> list[str]:
        found: list[str] = []
        for name, child in module.named_children():
            fqn = prefix + name
            if container is not None and fqn == container:
                found += [f"{fqn}.{k}" for k, _ in child.named_children()]
            elif container is not None and container.startswith(fqn + "."):
                found += walk(child, fqn + ".")
            else:
                found.append(fqn)
        return found

    return walk(model, "")


def even_split_points(model: nn.Module, num_stages: int, *, fn: str) -> list[str]:
    """Split points that spread the repeated blocks evenly over `num_stages` stages.

    Earlier stages take one block more when the count does not divide; the units before the
    first block join the first stage and those after the last block the last stage.
    """
    container = blocks_container(model)
    if container is None:
        raise ValueError(
            f"{fn}: split_points=None spreads repeated blocks evenly, and {type(model).__name__} "
            "has no nn.ModuleList/ModuleDict of blocks of one class; name the cuts, e.g. "
            "split_points=('layers.2',)."
        )
    blocks = [u for u in units(model) if u.startswith(container + ".")]
    if num_stages > len(blocks):
        raise ValueError(
            f"{fn}: {num_stages} stages but {container!r} holds {len(blocks)} blocks; every "
            f"stage needs at least one block. Use at most {len(blocks)} stages (fewer pp ranks "
            "or stages_per_rank), or give split_points."
        )
    base, extra = divmod(len(blocks), num_stages)
    points, start = [], 0
    for stage in range(num_stages - 1):
        start += base + (1 if stage < extra else 0)
        points.append(blocks[start])
    return points


def stage_units(
    all_units: Sequence[str], split_points: Sequence[str], *, fn: str
) -> list[list[str]]:
    """The units of each stage: split point k starts stage k + 1.

    Example:
        >>> stage_units(["emb", "layers.0", "layers.1", "head"], ["layers.1"], fn="f")
        [['emb', 'layers.0'], ['layers.1', 'head']]
    """
    index = {u: i for i, u in enumerate(all_units)}
    cuts = []
    for point in split_points:
        if point not in index:
            raise ValueError(
                f"{fn}: split_points contains {point!r}, which names no unit of the model; "
                f"expected names from {list(all_units)}. Use one of those."
            )
        cuts.append(index[point])
    if cuts != sorted(set(cuts)) or (cuts and cuts[0] == 0):
        raise ValueError(
            f"{fn}: split_points={list(split_points)!r} must be distinct units in model order, "
            f"after the first unit {all_units[0]!r} (each starts a non-empty stage)."
        )
    bounds = [0, *cuts, len(all_units)]
    return [list(all_units[a:b]) for a, b in itertools.pairwise(bounds)]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _skeleton(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s tensors, with its own dicts of children and hooks.

    copy.copy alone shares the `_modules` and hook dicts, so wrapping one stage (FSDP2 adds
    hooks and swaps the class) would change the model and every other stage.
    """
    new = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set, list)):
            new.__dict__[key] = copy.copy(value)
    return new


def stage_module(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """The model's skeleton holding the units in `keep` (and parameter-free ones), Identity else."""
    kept = set(keep)
    container = blocks_container(model)

    def prune(module: nn.Module, prefix: str) -> nn.Module:
        new = _skeleton(module)
        for name, child in module.named_children():
            fqn = prefix + name
            if container is not None and fqn == container:
                blocks = _skeleton(child)
                blocks._modules = {
                    k: b for k, b in child.named_children() if f"{fqn}.{k}" in kept
                }  # sparse keys: iteration and names stay those of the whole model
                new._modules[name] = blocks
            elif container is not None and container.startswith(fqn + "."):
                new._modules[name] = prune(child, fqn + ".")
            elif fqn not in kept and _has_params(child):
                new._modules[name] = nn.Identity()
        return new

    return prune(model, "")
