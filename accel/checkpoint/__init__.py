"""Checkpoints: model weights as Hugging Face safetensors, and crash-safe training state.

`save_model` / `load_checkpoint_in_model` read and write the weights alone, in the layout other
tools read. `save_state` / `load_state` hold everything a run needs to resume exactly (model,
optimizer, scheduler, scaler, loader position, RNG states of every rank, any object with
`state_dict`/`load_state_dict`). `save_checkpoint` / `latest_checkpoint` number, rotate and find
them, optionally writing in the background. Every save goes through `_atomic`: it is
either complete under its final name or absent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from accel._size import parse_size
from accel._store.exports import fetch_export
from accel._store.staging import named_as, transfer_folder
from accel._store.urls import Remote, locate
from accel.checkpoint import _atomic
from accel.checkpoint._deepspeed_state import engines_as_state
from accel.checkpoint._exporting import export, export_to_store
from accel.checkpoint._model_load import load_into
from accel.checkpoint._remote import committed_steps, load_remote
from accel.checkpoint._remote import rotate as remote_rotate
from accel.checkpoint._saving import CheckpointHandle, group_of, start_save
from accel.checkpoint._state_io import PerRank, load
from accel.checkpoint._steps import complete_steps, rotate
from accel.context import RunContext
from accel.parallel import unwrap_model

__all__ = [
    "CheckpointHandle",
    "LoadResult",
    "PerRank",
    "latest_checkpoint",
    "load_checkpoint_in_model",
    "load_state",
    "save_checkpoint",
    "save_model",
    "save_state",
]

logger = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    """Keys `load_checkpoint_in_model` left alone (with strict=False) or ignored."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# ---------------------------------------------------------------------------------- weights


def save_model(
    ctx: RunContext,
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    full_state_dict: bool = False,
) -> None:
    """Write the unwrapped model's weights as safetensors in the Hugging Face layout.

    One `model.safetensors` when it fits in `max_shard_size`, else
    `model-0000k-of-0000N.safetensors` shards and a `model.safetensors.index.json`. Tied
    tensors are stored once (under their first name) and `load_checkpoint_in_model` restores
    them tied. Rank 0 writes; every rank returns once the files are durable. An accel manifest
    (sizes, checksums) is written beside them. `save_model`'s own files of an earlier save in
    another layout (shards, index, single file) are removed; other files are left alone.
    A kill at any instant leaves the folder loadable as the complete previous export or the
    complete new one (a journal the next load or save finishes; docs/checkpoints.md).
    A sharded model (FSDP2, tensor parallel, both) is written without gathering: the files,
    byte-identical to those of the same model unsharded, are laid out from global shapes and
    every rank writes its own slices into place (call it on every rank); where the ranks do
    not share `directory`'s filesystem, the tensors are streamed to rank 0 one at a time.
    `full_state_dict=True` gathers the whole model instead.

    Args:
        ctx: the run context; rank 0 writes, and every rank returns once the files are durable.
        model: the model, wrapped or not (DDP, FSDP2, `torch.compile`); it is unwrapped first.
        directory: the folder to write into; created if missing. Or a URL (`s3://...`): written
            locally, then uploaded with the manifest last (docs/checkpoints.md).
        max_shard_size: the most bytes per file, an int or a string such as "5GB" (default).
        full_state_dict: gather a sharded model to full weights on every rank and write from
            rank 0; default False (each rank writes its slices).

    Raises:
        ValueError: for a bad `max_shard_size`, or a tensor on the meta device.
        OSError: a write failed (disk full, read-only folder); it names the folder and the
            file, the partial files are removed and the folder's files are as they were.

    Example:
        >>> from pathlib import Path
        >>> from torch import nn
        >>> from accel import RunContext, save_model
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> save_model(RunContext.single(), nn.Linear(2, 2), d)
        >>> sorted(p.name for p in Path(d).iterdir())
        ['accel-manifest.json', 'model.safetensors']
    """
    fn = "save_model"
    _check_model(fn, model)
    where = locate(fn, "directory", directory)
    max_bytes = parse_size(fn, "max_shard_size", max_shard_size, minimum=1)
    if isinstance(where, Remote):
        export_to_store(ctx, model, where, max_bytes, full_state_dict)
    else:
        export(ctx, model, _atomic.as_folder(fn, "directory", where), max_bytes, full_state_dict)


def _check_model(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{fn}: model={model!r:.60} is a {type(model).__name__}, not a torch.nn.Module; pass "
            "the model (the checkpoint path is the next argument)."
        )


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device: torch.device | str | int | None = None,
    strict: bool = True,
) -> LoadResult:
    """Load safetensors weights (a file, an index, or a folder) into `model` in place.

    An empty model (built under `init_empty_weights`) is filled on the CPU, or on `device`
    (Accelerate's `device_map={"": 0}` is `device=0`); tied weights stay tied and take the
    dtype the model declares. With `device`, a real model's tensors move there too. Placing
    modules across devices is `dispatch_checkpoint`'s job.

    Shapes must match (an error names the tensor and both shapes); with `strict`, so must the
    key sets. When the folder holds an accel manifest (written by `save_model`), each file's
    size and checksum are verified first. Index entries pointing outside the folder (`../`,
    absolute paths), and files that are symbolic links leading out of it, are refused before
    any file is opened. An export a killed `save_model` left half published is finished first.

    A sharded model (FSDP2, tensor parallel, both; built under `init_empty_weights` and sharded
    on meta included) loads slice by slice: call it on every rank; each rank reads only the
    bytes of its own slices, straight into its local shards, and never holds a full tensor it
    does not own (the checksums are split across ranks, so verifying costs one read in total).

    Args:
        model: the model to fill, wrapped or not; a sharded one takes each rank's slices.
        checkpoint: a `.safetensors` file, a `.safetensors.index.json`, or a folder of either;
            or its URL (`s3://...`), downloaded first and checked against its manifest.
        device: where to put the tensors (an int is a CUDA index); default: an empty (meta)
            model is filled on the CPU, a real one is loaded where its tensors are.
        strict: require the key sets to match; default True (False loads the matching ones).

    Returns:
        A `LoadResult`: the model's keys the checkpoint lacked and the checkpoint's keys the
        model lacks, each sorted (both empty when `strict` succeeds).

    Raises:
        FileNotFoundError: when `checkpoint`, or a file its index names, does not exist.
        ValueError: for a shape mismatch, key sets that differ under `strict`, a bad index or
            manifest, a file whose size or checksum differs from the manifest, or a meta
            tensor the checkpoint does not hold.

    Example:
        >>> from torch import nn
        >>> from accel import load_checkpoint_in_model, RunContext, save_model
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> save_model(RunContext.single(), nn.Linear(2, 2, bias=False), d)
        >>> load_checkpoint_in_model(nn.Linear(2, 2, bias=False), d)
        LoadResult(missing_keys=[], unexpected_keys=[])
    """
    fn = "load_checkpoint_in_model"
    _check_model(fn, model)
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device) if device is not None else None
    where = locate(fn, "checkpoint", checkpoint)
    if not isinstance(where, Remote):
        return LoadResult(*load_into(fn, unwrap_model(model), where, device, strict))
    with transfer_folder("download") as folder, named_as(folder, where.url):
        local = fetch_export(fn, where, folder)  # each rank its own copy, checked
        return LoadResult(*load_into(fn, unwrap_model(model), local, device, strict))


# ---------------------------------------------------------------------------------- state


def save_state(
    ctx: RunContext,
    directory: str | os.PathLike[str],
    state: Mapping[str, Any] | None = None,
    /,
    **objects: Any,
) -> None:
    """Save training state under `directory`, crash-safely, for an exact resume with load_state.

    Pass the objects as one dict of name -> object, `state`, the same dict `save_checkpoint`
    and `load_state` take (or as keyword arguments; the two combine): models (saved unwrapped;
    FSDP2 models and their optimizers sharded through torch.distributed.checkpoint; a
    DeepSpeed engine as each rank's ZeRO state, its optimizer within it),
    optimizers, schedulers, GradScaler, loaders, `torch.Generator`, or anything with
    `state_dict`/`load_state_dict`.
    Objects are saved once, from rank 0, unless wrapped in `PerRank`; the RNG states of every
    rank are always saved, and so are the gradients a model has accumulated inside an
    accumulation window (each rank its own; `load_state` restores them, or clears stale ones).
    Tensors go to safetensors and everything else to JSON: nothing is pickled. The directory is
    written under a temporary name, fsynced with a manifest of sizes and crc32 checksums, and
    renamed into place; call it on every rank. An existing accel checkpoint under `directory`
    is replaced; a folder holding other files (FileExistsError) or a file (NotADirectoryError)
    is refused before anything is written. A failed save removes what it wrote.

    Args:
        ctx: the run context; every rank calls with the same names.
        directory: the folder to create; an existing accel checkpoint is replaced once the new
            one is done; any other existing folder with files in it is refused. Or a URL of an
            object store (`s3://bucket/run`, `gs://...`): committed by its manifest, written
            last (docs/checkpoints.md, "Object storage").
        state: name -> object, e.g. `{"model": model, "optimizer": opt}`; `PerRank(obj)`
            saves every rank's own copy.
        **objects: more objects by name, as keyword arguments.

    Raises:
        TypeError: for an object with no `state_dict`/`load_state_dict` (nor a Generator), or
            a `state` that is not a dict of str names.
        ValueError: for a name reserved for the RNG states, or given both in `state` and as a
            keyword.
        FileExistsError: `directory` holds files but is not an accel checkpoint.
        NotADirectoryError: `directory` (or a parent) is a file.
        OSError: a write failed (disk full, read-only); it names the checkpoint, and what was
            written is removed.
        TimeoutError: on rank 0, when a rank's files are missing after `ctx.timeout` (None:
            30 minutes).

    Example:
        >>> import torch
        >>> from pathlib import Path
        >>> from torch import nn
        >>> from accel import load_state, RunContext, save_state
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "state"
        >>> model = nn.Linear(2, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> state = {"model": model, "optimizer": opt}
        >>> save_state(RunContext.single(), d, state)
        >>> load_state(RunContext.single(), d, state)["objects"]
        ['model', 'optimizer']
    """
    fn = "save_state"
    target = locate(fn, "directory", directory)
    start_save(fn, ctx, target, _objects(fn, state, objects), info={}, blocking=True)


def _objects(fn: str, state: object, objects: dict[str, Any]) -> dict[str, Any]:
    """The one dict of a checkpoint's objects: `state`'s entries and the keyword arguments."""
    if state is None:
        return engines_as_state(fn, objects)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise TypeError(
            f"{fn}: state={state!r:.80} must be a dict of name -> object, e.g. "
            '{"model": model, "optimizer": optimizer}.'
        )
    both = sorted(state.keys() & objects.keys())
    if both:
        raise ValueError(
            f"{fn}: {both} given both in state and as keyword arguments; each name once. Put "
            "every object in the state dict."
        )
    return engines_as_state(fn, {**state, **objects})


def load_state(
    ctx: RunContext,
    directory: str | os.PathLike[str],
    state: Mapping[str, Any] | None = None,
    /,
    **objects: Any,
) -> dict[str, Any]:
    """Load what `save_state` saved into the given objects, in place, and restore RNG states.

    Refuses a directory with no manifest, and any file whose size, checksum or header is wrong
    (naming it). Every file is verified before any object or RNG state changes, so a failed
    load leaves them as they were. FSDP2 state loads at any world size. Call it on every rank.
    A rank with no saved RNG state (saved by fewer ranks) is seeded from the run seed
    (`set_seed(ctx.seed, ctx=ctx)`), or warns and keeps its own when `ctx.seed` is None; the
    states of ranks that no longer exist are not used.

    Args:
        ctx: the run context; its rank picks the RNG state and `PerRank` files to load.
        directory: a folder written by `save_state` (or `save_checkpoint`), or its URL.
        state: name -> object to load into, in place, by the names they were saved under (the
            dict given to `save_state` or `save_checkpoint`).
        **objects: more objects by name, as keyword arguments.

    Returns:
        The manifest (`step`, `world_size`, versions, files).

    Raises:
        FileNotFoundError: when `directory` or its manifest does not exist.
        TypeError: for an object with no `state_dict`/`load_state_dict` (nor a Generator).
        ValueError: for a name that was not saved, a file whose size or checksum differs from
            the manifest, or a model whose shapes or keys differ from the saved one.

    Example:
        >>> import torch
        >>> from pathlib import Path
        >>> from accel import load_state, RunContext, save_state
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "state"
        >>> save_state(RunContext.single(), d, gen=torch.Generator().manual_seed(1))
        >>> g = torch.Generator()
        >>> load_state(RunContext.single(), d, gen=g)["world_size"], g.initial_seed()
        (1, 1)
    """

    fn = "load_state"
    target = locate(fn, "directory", directory)
    loaded = _objects(fn, state, objects)
    if isinstance(target, Remote):
        return load_remote(fn, ctx, target, loaded, group_of(ctx, fn))
    return load(fn, ctx, target, loaded, group_of(ctx, fn))


def save_checkpoint(
    ctx: RunContext,
    root: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int,
    keep: int | None = None,
    blocking: bool = True,
) -> CheckpointHandle:
    """Save `state` (the dict save_state takes) as `root/step-<step>`; keep the newest `keep`.

    Older checkpoints are deleted only after the new one is published, so `keep=1` never leaves
    zero complete checkpoints. With `blocking=False` the call returns once tensors are copied to
    host memory; the write and fsync run in a background thread. The next save (or
    `handle.wait()`) waits for it, and a crash during it leaves the previous checkpoint latest.

    Args:
        ctx: the run context; call it on every rank.
        root: the folder of `step-<n>` checkpoints; created if missing. Or a URL
            (`s3://bucket/run`): each step is committed by its manifest, written last.
        state: name -> object, the same dict `save_state` and `load_state` take.
        step: the training step, an int >= 0, which names the folder.
        keep: how many of the newest complete checkpoints to keep; default None keeps all.
        blocking: return only once the checkpoint is published; default True.

    Returns:
        A `CheckpointHandle`; its `wait()` returns the path once durable, or re-raises.

    Raises:
        ValueError: for a `step` that is not an int >= 0, or a `keep` not None or >= 1.
        TypeError: for an object `save_state` cannot save.

    Example:
        >>> from torch import nn
        >>> from accel import latest_checkpoint, RunContext, save_checkpoint
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> model = nn.Linear(2, 2)
        >>> h = save_checkpoint(RunContext.single(), root, {"model": model}, step=3, keep=1)
        >>> h.wait().name, latest_checkpoint(root).name
        ('step-3', 'step-3')
    """
    fn = "save_checkpoint"
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{fn}: state={type(state).__name__} must be a dict of name -> object, e.g. "
            '{"model": model, "optimizer": optimizer}.'
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{fn}: step={step!r} must be a non-negative int (the training step).")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"{fn}: keep={keep!r} must be None (keep all) or an int >= 1.")
    where = locate(fn, "root", root)
    if isinstance(where, Remote):
        final: Path | Remote = where.child(f"step-{step}")
        after_publish = None if keep is None else partial(remote_rotate, fn, where, keep, step)
    else:
        root_path = _atomic.as_folder(fn, "root", where)
        final = root_path / f"step-{step}"
        _atomic.check_target(fn, final)
        root_path.mkdir(parents=True, exist_ok=True)
        after_publish = None if keep is None else partial(rotate, root_path, keep, step)
    return start_save(
        fn,
        ctx,
        final,
        _objects(fn, state, {}),
        info={"step": step},
        blocking=blocking,
        after_publish=after_publish,
        numbered=True,
    )


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | str | None:
    """Find the newest complete `root/step-<n>` checkpoint (manifest present, sizes match).

    Checksums are not read here; `load_state` verifies them.

    Args:
        root: the folder `save_checkpoint` writes into; it need not exist. Or its URL.

    Returns:
        The path of the complete checkpoint with the highest step (its URL, a str, for a
        root in a store: only committed steps), or None.

    Folders that are incomplete or damaged are skipped (logged at debug level); a `root` that
    does not exist yet gives None, one that is a file raises NotADirectoryError.

    Example:
        >>> from accel import latest_checkpoint
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    fn = "latest_checkpoint"
    where = locate(fn, "root", root)
    if isinstance(where, Remote):
        committed = committed_steps(fn, where, newest_only=True)
        return committed[-1][1].url if committed else None
    complete = complete_steps(_atomic.as_folder(fn, "root", where))
    return complete[-1][1] if complete else None
