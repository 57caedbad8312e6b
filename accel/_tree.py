"""The one traversal primitive over nested tuples, lists and dicts of tensors.

Collectives, device placement and dtype casts all go through `flatten` / `unflatten`, so the
nesting rules (namedtuples keep their type, dicts keep their key order) are written once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class TreeDef:
    """The shape of a nest with its leaves taken out."""

    kind: str  # "leaf", "tuple", "namedtuple", "list", "dict"
    node_type: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[TreeDef, ...] = ()

    @property
    def num_leaves(self) -> int:
        return 1 if self.kind == "leaf" else sum(c.num_leaves for c in self.children)


_LEAF = TreeDef("leaf")


def flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Return the leaves of `tree` in a fixed order and the structure to rebuild it."""
    leaves: list[Any] = []
    return leaves, _flatten_into(tree, leaves)


def _flatten_into(tree: Any, leaves: list[Any]) -> TreeDef:
    if isinstance(tree, Mapping):
        keys = tuple(tree.keys())
        kids = tuple(_flatten_into(tree[k], leaves) for k in keys)
        return TreeDef("dict", type(tree), keys, kids)
    if isinstance(tree, tuple):
        kind = "namedtuple" if hasattr(tree, "_fields") else "tuple"
        return TreeDef(kind, type(tree), (), tuple(_flatten_into(x, leaves) for x in tree))
    if isinstance(tree, list):
        return TreeDef("list", list, (), tuple(_flatten_into(x, leaves) for x in tree))
    leaves.append(tree)
    return _LEAF


def unflatten(treedef: TreeDef, leaves: list[Any]) -> Any:
    """Rebuild a nest of the shape `treedef` from `leaves` (the inverse of `flatten`)."""
    it = iter(leaves)
    out = _build(treedef, it)
    assert next(it, None) is None, "more leaves than the tree has slots"
    return out


def _build(td: TreeDef, it: Any) -> Any:
    if td.kind == "leaf":
        return next(it)
    kids = [_build(c, it) for c in td.children]
    if td.kind == "dict":
        assert td.node_type is not None
        values = dict(zip(td.keys, kids, strict=True))
        return values if td.node_type is dict else td.node_type(values)
    if td.kind == "namedtuple":
        assert td.node_type is not None
        return td.node_type(*kids)
    if td.kind == "tuple":
        return tuple(kids)
    return kids


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply `fn` to every leaf of `tree`, keeping its structure."""
    leaves, treedef = flatten(tree)
    return unflatten(treedef, [fn(x) for x in leaves])


def tensor_leaves(fn_name: str, tree: Any) -> tuple[list[torch.Tensor], TreeDef]:
    """Flatten `tree` and check that every leaf is a tensor, naming `fn_name` if one is not."""
    leaves, treedef = flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{fn_name}: leaf {i} of the input is a {type(leaf).__name__} ({leaf!r:.60}); "
                "expected tensors in nested tuples, lists and dicts. Wrap numbers with "
                "torch.tensor(...), or use the *_object variant for arbitrary Python objects."
            )
    return leaves, treedef


def send_to_device(tree: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor leaf of `tree` to `device`; other leaves are returned unchanged."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=non_blocking)
        return x

    return tree_map(move, tree)
