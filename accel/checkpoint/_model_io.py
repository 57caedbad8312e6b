"""Model weights as safetensors: tied tensors saved once, shards by size, strict shape checks."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from accel._dtensor import is_dtensor, is_sharded
from accel._groups import describe
from accel._safetensors import manifests
from accel._safetensors.exports import JOURNAL, OWN_FILES, export_lock, fsync_path, write_journal
from accel._safetensors.exports import complete as complete_export
from accel._safetensors.exports import partial_path as partial_path  # where callers import it
from accel._safetensors.files import INDEX_NAME, SINGLE_NAME
from accel._version import __version__
from accel.checkpoint import _atomic
from accel.checkpoint._safetensors_io import write_file


def storage_view(t: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors one: the same bytes of the same storage, seen the same way."""
    return (
        t.untyped_storage().data_ptr(), t.device, t.storage_offset(), t.dtype, tuple(t.shape),
        t.stride(),
    )  # fmt: skip


def dedupe_tied(
    state: Mapping[str, torch.Tensor], *, allow_meta: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one name per shared tensor; return (tensors to save, alias name -> saved name).

    Meta tensors (no data) are refused unless `allow_meta`; then ties are found by identity,
    so `state` must hold the model's own tensors (`state_dict(keep_vars=True)`).
    """
    kept: dict[tuple[object, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key: tuple[object, ...]
        if t.device.type == "meta":
            if not allow_meta:
                raise ValueError(f"save_model: tensor {name!r} is on the meta device (no data).")
            key = ("meta", id(t))
        elif is_dtensor(t):  # a sharded parameter: tied parameters are the same object
            key = ("dtensor", id(t))
        else:
            key = storage_view(t)
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


FILE_METADATA = MappingProxyType({"format": "pt"})  # what transformers writes and expects


def file_layout(
    tensors: Mapping[str, torch.Tensor], max_bytes: int
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """(file name, tensors) of each file `save_model` writes, in order; sizes from global shapes."""
    shards = split_shards(tensors, max_bytes)
    if len(shards) == 1:
        return [(SINGLE_NAME, shards[0])]
    return [(shard_name(i, len(shards)), shard) for i, shard in enumerate(shards)]


def check_against_model(
    fn: str, model: nn.Module, loaded: Mapping[str, torch.Tensor], *, strict: bool
) -> dict[str, torch.Tensor]:
    """Validate `loaded` against the model's own tensors; fill tied aliases; return a state dict.

    Raises ValueError naming the tensor and both shapes on a mismatch (always), and naming the
    missing or unexpected keys when `strict`.
    """
    own = model.state_dict(keep_vars=True)  # the model's own tensors: ties by identity on meta
    _, own_aliases = dedupe_tied(own, allow_meta=True)
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


def load_full_state(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool) -> None:
    """Load full (unsharded) tensors into `model`, which may be sharded (FSDP2, TP).

    `state` is already checked against the model (`check_against_model`); a sharded model takes
    each rank's slice of every full tensor through torch's `set_model_state_dict`.
    """
    if not is_sharded(model):
        model.load_state_dict(state, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import (  # on use: ~1 s to import
        StateDictOptions,
        set_model_state_dict,
    )

    set_model_state_dict(
        model, dict[str, Any](state), options=StateDictOptions(full_state_dict=True, strict=strict)
    )


def fill(
    fn: str, model: nn.Module, state: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Put `state`'s tensors into `model` on `device` (a model built on meta included): each
    tensor once, shared by all its tied names, in the dtype the model declares. A meta tensor
    the checkpoint lacks is refused; other tensors it lacks (a rotary table) are moved along."""
    groups: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                groups.setdefault(id(t), []).append((module, attr, f"{prefix}.{attr}".lstrip(".")))
    empty = [
        members[0][2]
        for members in groups.values()
        if _get(members[0]).is_meta and not any(m[2] in state for m in members)
    ]
    if empty:
        raise ValueError(
            f"{fn}: the model's tensors {empty[:10]} ({len(empty)}) are on the meta device and "
            "the checkpoint does not hold them (non-persistent buffers?). Build the model with "
            "init_empty_weights(include_buffers=False) so buffers are computed on the CPU."
        )
    for members in groups.values():
        old = _get(members[0])
        source = next((state[m[2]] for m in members if m[2] in state), old)
        value = source.detach().to(device=device, dtype=old.dtype)
        if isinstance(old, nn.Parameter):
            value = nn.Parameter(value, old.requires_grad)
        for module, attr, _ in members:
            table = module._parameters if attr in module._parameters else module._buffers
            table[attr] = value  # type: ignore[assignment]


def _get(member: tuple[nn.Module, str, str]) -> torch.Tensor:
    module, attr, _ = member
    t = module._parameters.get(attr)
    return t if t is not None else module._buffers[attr]  # type: ignore[return-value]


def write_model_files(directory: Path, state: Mapping[str, torch.Tensor], max_bytes: int) -> None:
    """Write the Hugging Face layout of a full state from this process, then publish it."""
    # Ties are found where the tensors sit, then each kept tensor moves: from a GPU every
    # `.cpu()` is a new tensor, so ties looked for after the move were never found there and
    # a tied head was written twice (the export depended on the device the model sat on).
    kept, aliases = dedupe_tied(state)
    tensors = {k: v.detach().cpu() for k, v in kept.items()}
    directory.mkdir(parents=True, exist_ok=True)
    with export_lock(directory):
        publish_model_files("save_model", directory, tensors, aliases, max_bytes, write_file)


def publish_model_files(
    fn: str,
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    max_bytes: int,
    write: Callable[..., tuple[int, int]],
) -> None:
    """Write each file with `write(path, tensors=, metadata=)` under its `partial_path`, then
    publish them through a journal (`accel._safetensors.exports`): renamed into place with the
    index and manifest, this layout's stale files removed. The caller holds `export_lock`.

    `write` returns the file's (size, crc32). A sharded save or `merge-weights` has already
    written every file under its `partial_path`, and passes a `write` that only reports them.
    Until the journal is written the folder's files are as they were, and a failed write
    removes the partial files (`partials_removed_on_failure`); once it is written, a kill at
    any instant leaves a folder the next load or save finishes publishing.
    """
    layout = file_layout(tensors, max_bytes)
    directory.mkdir(parents=True, exist_ok=True)
    entries: dict[str, list[int]] = {}
    names = [name for name, _ in layout] + [INDEX_NAME, JOURNAL]
    with partials_removed_on_failure(fn, directory, names):
        for name, shard in layout:
            hidden = partial_path(directory / name)
            entries[name] = list(write(hidden, tensors=shard, metadata=FILE_METADATA))
        if len(layout) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {
                "metadata": {"total_size": total, "tied": dict(aliases)},
                "weight_map": {k: name for name, shard in layout for k in shard},
            }
            data = json.dumps(index, indent=2).encode()
            hidden = partial_path(directory / INDEX_NAME)
            entries[INDEX_NAME] = list(_atomic.write_bytes(hidden, data))
        manifest = {
            "format": manifests.FORMAT,
            "accel_version": __version__,
            "torch_version": torch.__version__,
            "files": entries,
        }
        own = (p.name for p in directory.iterdir() if OWN_FILES.fullmatch(p.name))
        # The old index goes first: a reader never follows it to shards already removed.
        stale = sorted((n for n in own if n not in entries), key=lambda n: (n != INDEX_NAME, n))
        fsync_path(directory)
        write_journal(directory, manifest, stale)
    complete_export(directory)


@contextmanager
def partials_removed_on_failure(fn: str, directory: Path, names: Iterable[str]) -> Iterator[None]:
    """If the block fails, remove the `partial_path` of each of `names` (this save's own files,
    not yet renamed into place) and raise a write error naming the folder and the fix."""
    try:
        yield
    except BaseException as err:
        for name in names:
            partial_path(directory / name).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno:
            raise OSError(
                err.errno,
                f"{fn}: writing into {str(directory)!r} failed: {describe(err)[1]}. The "
                "partial files were removed and the folder's files are as they were; free "
                "space (or lift the file-size limit), then save again.",
            ) from err
        raise
