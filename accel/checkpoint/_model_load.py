"""`load_checkpoint_in_model`'s work: a checkpoint's files into a model, whole or by slices."""

from __future__ import annotations

import os

import torch
from torch import nn

from accel._dtensor import is_sharded
from accel._safetensors import manifests
from accel._safetensors.files import resolve_checkpoint
from accel.checkpoint._model_io import check_against_model, fill, load_full_state
from accel.checkpoint._safetensors_io import read_file
from accel.checkpoint._sharded_io import load_sharded


def load_into(
    fn: str,
    inner: nn.Module,
    checkpoint: str | os.PathLike[str],
    device: torch.device | None,
    strict: bool,
) -> tuple[list[str], list[str]]:
    """Load `checkpoint` into the unwrapped model `inner`; return (missing, unexpected) keys."""
    files = resolve_checkpoint(fn, checkpoint)
    manifest_path = files.files[0].parent / manifests.MANIFEST
    manifest = (
        manifests.read_manifest(fn, manifest_path.parent) if manifest_path.is_file() else None
    )
    if is_sharded(inner):  # each rank reads only its own slices
        sums = {p: manifests.expected(manifest, p.name) if manifest else None for p in files.files}
        cpu = device or torch.device("cpu")
        return load_sharded(fn, inner, files, sums, device=cpu, strict=strict)
    loaded: dict[str, torch.Tensor] = {}
    for path in files.files:
        expect = manifests.expected(manifest, path.name) if manifest else None
        loaded.update(read_file(fn, path, expect))
    state = check_against_model(fn, inner, loaded, strict=strict)
    if device is None and not any(t.is_meta for t in inner.state_dict(keep_vars=True).values()):
        load_full_state(inner, state, strict=strict)
    else:
        fill(fn, inner, state, device or torch.device("cpu"))
    own = inner.state_dict().keys()
    return sorted(own - state.keys()), sorted(loaded.keys() - own)
