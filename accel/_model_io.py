"""Model weights as safetensors: tied tensors saved once, shards by size, strict shape checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

_UNITS = MappingProxyType(
    {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
)


def parse_size(fn: str, size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "5GB", "500MB", "2GiB" (Hugging Face units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", str(size).upper())
    if match is None or float(match[1]) <= 0:
        raise ValueError(
            f"{fn}: max_shard_size={size!r} is not a positive size; pass bytes as an int or a "
            "string such as '5GB', '500MB' or '2GiB'."
        )
    return int(float(match[1]) * _UNITS[match[2]])


def dedupe_tied(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor; return (tensors to save, alias name -> saved name)."""
    kept: dict[tuple[object, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        if t.device.type == "meta":
            raise ValueError(f"save_model: tensor {name!r} is on the meta device (no data).")
        key: tuple[object, ...]
        if hasattr(t, "to_local"):  # an FSDP2 DTensor: tied parameters are the same object
            key = ("dtensor", id(t))
        else:
            key = (
                t.untyped_storage().data_ptr(), t.device, t.storage_offset(), t.dtype,
                tuple(t.shape), t.stride(),
            )  # fmt: skip
        if t.numel() > 0 and key in kept:
            aliases[name] = kept[key]
        else:
            kept[key] = name
            tensors[name] = t
    return tensors, aliases


def split_shards(
    tensors: Mapping[str, torch.Tensor], max_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Greedy, in order: start a new shard when the next tensor would pass `max_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += size
    return shards


def shard_name(i: int, n: int) -> str:
    """The Hugging Face shard name: model-00001-of-00003.safetensors."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def check_against_model(
    fn: str, model: nn.Module, loaded: Mapping[str, torch.Tensor], *, strict: bool
) -> dict[str, torch.Tensor]:
    """Validate `loaded` against the model's own tensors; fill tied aliases; return a state dict.

    Raises ValueError naming the tensor and both shapes on a mismatch (always), and naming the
    missing or unexpected keys when `strict`.
    """
    own = model.state_dict()
    _, own_aliases = dedupe_tied(own)
    state = dict(loaded)
    for alias, kept in own_aliases.items():
        if alias not in state and kept in state:
            state[alias] = state[kept]  # a tied tensor saved once: restore both names
        elif kept not in state and alias in state:
            state[kept] = state[alias]
    for name, t in state.items():
        if name in own and tuple(own[name].shape) != tuple(t.shape):
            raise ValueError(
                f"{fn}: tensor {name!r} has shape {tuple(t.shape)} in the checkpoint but "
                f"{tuple(own[name].shape)} in the model; the checkpoint belongs to another "
                "model or configuration. Build the model that was saved."
            )
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    if strict and (missing or unexpected):
        raise ValueError(
            f"{fn}: the checkpoint does not match the model: missing {missing[:10]} "
            f"({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)}). Load the "
            "checkpoint of this model, or pass strict=False to load the matching tensors."
        )
    return {k: v for k, v in state.items() if k in own}
