"""Split a state_dict tree into JSON (structure, numbers, strings) and named tensors.

Nothing here unpickles: the structure is tagged JSON and the tensors go to safetensors, so a
checkpoint file can describe data but never code. Types outside the table below are refused
with the path to the value, rather than silently pickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__dtype__", "__device__")


def encode(fn: str, tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-able copy of `tree`; its tensors are added to `tensors` under path keys."""
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach()
        return {"__tensor__": prefix}
    if isinstance(tree, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(tree))
        return {"__ndarray__": prefix}
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, torch.dtype):
        return {"__dtype__": str(tree).removeprefix("torch.")}
    if isinstance(tree, torch.device):
        return {"__device__": str(tree)}
    if isinstance(tree, tuple):  # includes torch.Size, restored as a tuple
        return {"__tuple__": [encode(fn, v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [encode(fn, v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, Mapping):
        if all(isinstance(k, str) and k not in _TAGS for k in tree):
            return {k: encode(fn, v, f"{prefix}.{k}", tensors) for k, v in tree.items()}
        return {
            "__dict__": [
                [
                    encode(fn, k, f"{prefix}.key{i}", tensors),
                    encode(fn, v, f"{prefix}.{k}", tensors),
                ]
                for i, (k, v) in enumerate(tree.items())
            ]
        }
    raise TypeError(
        f"{fn}: the state at {prefix!r} is a {type(tree).__name__}, which accel does not store "
        "(allowed: tensors, numpy arrays, numbers, strings, None, dtypes, devices, and lists, "
        "tuples and dicts of these). Return plain values from state_dict() instead."
    )


def decode(fn: str, tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Invert `encode`, taking tensors from `tensors`."""
    if isinstance(tree, list):
        return [decode(fn, v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, value),) = tree.items()
        if tag in ("__tensor__", "__ndarray__"):
            if value not in tensors:
                raise ValueError(f"{fn}: the state names tensor {value!r}, which is missing.")
            t = tensors[value]
            return t.numpy() if tag == "__ndarray__" else t
        if tag == "__tuple__":
            return tuple(decode(fn, v, tensors) for v in value)
        if tag == "__dict__":
            return {decode(fn, k, tensors): decode(fn, v, tensors) for k, v in value}
        if tag == "__dtype__":
            dtype = getattr(torch, str(value), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{fn}: the state names an unknown dtype {value!r}.")
            return dtype
        if tag == "__device__":
            return torch.device(str(value))
    return {k: decode(fn, v, tensors) for k, v in tree.items()}
