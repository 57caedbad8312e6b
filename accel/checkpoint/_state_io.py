"""The machinery of save_state / load_state: classify objects, snapshot, write, publish, read.

Layout of a state directory (every rank sees the same filesystem, as with torch DCP):

    accel-manifest.json          written last: files, sizes, crc32, versions, world size
    <name>.json                  the object's state structure and numbers (tagged JSON)
    <name>.safetensors           the object's tensors
    <name>/rank<r>.{json,safetensors}   a PerRank object, one pair per rank
    <name>/grads-rank<r>.{json,safetensors}   a model's gradients inside an accumulation window
    rng/rank<r>.{json,safetensors}      each rank's Python, NumPy, torch and CUDA RNG states
    dcp/                         FSDP2 models and optimizers, sharded by torch DCP

Ranks coordinate the publish through marker files in the staging directory, not collectives,
so the write can run in a background thread while training runs its own collectives.
"""

from __future__ import annotations

import json
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._dtensor import is_sharded
from accel._safetensors import manifests
from accel._safetensors.exports import fsync_path
from accel._safetensors.files import check_inside
from accel.checkpoint import _atomic, _dcp
from accel.checkpoint._deepspeed_state import EngineState
from accel.checkpoint._fsdp_grads import UNSHARDED, restore_window_grads, window_grads
from accel.checkpoint._model_io import check_against_model, dedupe_tied, load_full_state
from accel.checkpoint._safetensors_io import PendingWrite, read_file, start_write
from accel.checkpoint._state_codec import decode, encode
from accel.context import RunContext
from accel.parallel import unwrap_model
from accel.seeding import get_rng_state, set_rng_state, set_seed

RNG = "rng"
GRADS = "grads"
Files = dict[str, tuple[dict[str, torch.Tensor], bytes]]


@dataclass(frozen=True, slots=True)
class PerRank:
    """Mark an object whose state differs between ranks, so every rank saves its own copy.

    By default `save_state` stores each object once, from rank 0 (data-parallel replicas are
    equal). Wrap what is not replicated: `save_state(ctx, d, state=PerRank(holder))`; load with
    the same wrapper. An object whose `state_is_per_rank` attribute is True (a `ShardedLoader`
    over a split stream) is saved per rank without the wrapper, and a model's accumulated
    gradients are saved per rank too.
    """

    obj: Any
    """The object (with `state_dict`/`load_state_dict`, or a `torch.Generator`)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with each object passed to save_state / load_state."""

    kinds: tuple[tuple[str, str], ...]
    """(name, kind) for objects stored as files: module, generator, stateful, per_rank."""
    dcp_models: tuple[tuple[str, nn.Module], ...]
    dcp_optimizers: tuple[tuple[str, torch.optim.Optimizer, str], ...]
    """(name, optimizer, name of its model)."""


def classify(
    fn: str,
    objects: dict[str, Any],
    dcp_names: frozenset[str] | None = None,
    *,
    pipelined: bool = False,
) -> Plan:
    """Sort the objects; raise TypeError naming one that cannot be saved.

    Models go through DCP when sharded or `pipelined` (each pp rank holds other stages, so
    rank 0 alone cannot write the model; saving) or when saved that way (`dcp_names`, loading).
    """

    kinds: list[tuple[str, str]] = []
    dcp_models: dict[str, nn.Module] = {}
    optimizers: list[tuple[str, torch.optim.Optimizer]] = []
    for name, obj in objects.items():
        if name == RNG:
            raise ValueError(f"{fn}: the name {name!r} is reserved for the RNG states; rename it.")
        target = _unwrapped(obj)
        if not isinstance(target, torch.Generator) and not (
            hasattr(target, "state_dict") and hasattr(target, "load_state_dict")
        ):
            raise TypeError(
                f"{fn}: {name}={type(target).__name__} has no state_dict()/load_state_dict(); "
                "pass models, optimizers, schedulers, scalers, loaders, torch.Generator or any "
                "object with both methods."
            )
        if isinstance(obj, PerRank) or getattr(obj, "state_is_per_rank", False) is True:
            kinds.append((name, "per_rank"))
        elif isinstance(obj, nn.Module) and (
            name in dcp_names
            if dcp_names is not None
            else pipelined or is_sharded(unwrap_model(obj))
        ):
            dcp_models[name] = unwrap_model(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            optimizers.append((name, obj))
        else:
            kinds.append((name, _kind(obj)))
    dcp_optimizers = []
    for name, opt in optimizers:
        owner = _dcp.owner_model(opt, dcp_models)
        if owner is None:
            kinds.append((name, "stateful"))
        else:
            dcp_optimizers.append((name, opt, owner))
    return Plan(tuple(kinds), tuple(dcp_models.items()), tuple(dcp_optimizers))


def _unwrapped(obj: Any) -> Any:
    return obj.obj if isinstance(obj, PerRank) else obj


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.Generator):
        return "generator"
    return "stateful"


def _state_of(kind: str, obj: Any) -> tuple[Any, dict[str, str]]:
    """(state tree, alias map) of one object."""
    if kind == "module":
        tensors, aliases = dedupe_tied(unwrap_model(obj).state_dict())
        return tensors, aliases
    if kind == "generator":
        return {"state": obj.get_state()}, {}
    return obj.state_dict(), {}


def _pack(
    fn: str, name: str, state: Any, extra: dict[str, Any], copy: bool
) -> tuple[dict[str, torch.Tensor], bytes]:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode(fn, state, name, tensors)
    if copy:  # blocking=False: training may change the originals while the write runs
        tensors = {k: v.to("cpu", copy=True) for k, v in tensors.items()}
    else:
        tensors = {k: v.cpu() for k, v in tensors.items()}
    return tensors, json.dumps({"state": skeleton, **extra}).encode()


def snapshot(fn: str, ctx: RunContext, plan: Plan, objects: dict[str, Any], copy: bool) -> Files:
    """The files this rank writes: relative stem -> (tensors, JSON bytes)."""

    files: Files = {}
    for name, kind in plan.kinds:
        if kind == "per_rank":
            obj = _unwrapped(objects[name])
            state, _ = _state_of(_kind(obj), obj)
            files[f"{name}/rank{ctx.rank}"] = _pack(fn, name, state, {"kind": _kind(obj)}, copy)
        elif ctx.is_main:
            state, aliases = _state_of(kind, objects[name])
            files[name] = _pack(fn, name, state, {"kind": kind, "aliases": aliases}, copy)
        if kind == "module" and (grads := accumulated_grads(objects[name])):
            # Inside an accumulation window: every rank's own sums (not reduced yet under DDP).
            files[_grad_stem(name, ctx.rank)] = _pack(fn, name, grads, {"kind": GRADS}, copy)
    for name, model in plan.dcp_models:
        if grads := window_grads(model):  # sharded, or FSDP2's unsharded sums in a window
            files[_grad_stem(name, ctx.rank)] = _pack(fn, name, grads, {"kind": GRADS}, copy)
    files[f"{RNG}/rank{ctx.rank}"] = _pack(fn, RNG, get_rng_state(), {"kind": RNG}, copy)
    return files


def accumulated_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The `.grad` of each parameter that has one (empty outside an accumulation window)."""
    return {n: p.grad for n, p in unwrap_model(model).named_parameters() if p.grad is not None}


def _grad_stem(name: str, rank: int) -> str:
    return f"{name}/{GRADS}-rank{rank}"


def write_rank_files(staging: Path, rank: int, files: Files) -> None:
    """Write, fsync, and leave a marker listing (size, crc32) of each file written."""
    entries: dict[str, list[int]] = {}
    pending: dict[str, PendingWrite] = {}
    written = []
    try:
        for stem, (tensors, skeleton) in files.items():
            _mkdirs_below(staging, Path(stem).parent)
            path = staging / f"{stem}.safetensors"
            # fsync after all writes, as a hand-written save would: the kernel writes the first
            # files back while the later ones are still being written, and the checksums of
            # the last chunks finish while the disk works.
            pending[f"{stem}.safetensors"] = start_write(path, tensors)
            entries[f"{stem}.json"] = list(
                _atomic.write_bytes(staging / f"{stem}.json", skeleton, fsync=False)
            )
            written += [path, staging / f"{stem}.json"]
        for path in written:
            fsync_path(path)
    finally:  # collect every checksum, also to end their threads when a write failed
        sums = {rel: list(p.result()) for rel, p in pending.items()}
    entries.update(sums)
    marker = staging / f".rank{rank}.done"
    # The marker only tells rank 0 this rank is done (its files are fsynced already); the
    # manifest rank 0 writes from it is what must be durable.
    _atomic.write_bytes(marker.with_suffix(".tmp"), json.dumps(entries).encode(), fsync=False)
    marker.with_suffix(".tmp").rename(marker)


def _mkdirs_below(staging: Path, relative: Path) -> None:
    """Create `staging / relative` one level at a time: never `staging` itself, which rank 0
    removes when the save fails (re-creating it would leave debris)."""
    path = staging
    for part in relative.parts:
        path /= part
        path.mkdir(exist_ok=True)


def finish(
    fn: str,
    staging: Path,
    final: Path,
    world_size: int,
    info: dict[str, Any],
    timeout_s: float,
    *,
    replace: bool,
) -> None:
    """Rank 0: wait for every rank's marker, then write the manifest and publish."""
    markers = [staging / f".rank{r}.done" for r in range(world_size)]
    failed = [_atomic.failed_marker(staging, r) for r in range(world_size)]
    _atomic.wait_for_files(markers, timeout_s, failed=failed)
    entries: dict[str, list[int]] = {}
    for marker in markers:
        entries.update(json.loads(marker.read_text()))
        marker.unlink()
    dcp_dir = staging / _dcp.DCP_DIR
    if dcp_dir.is_dir():
        for path in sorted(dcp_dir.rglob("*")):
            if path.is_file():
                entries[path.relative_to(staging).as_posix()] = list(manifests.checksum_file(path))
    info = {"world_size": world_size, **info}
    _atomic.publish(fn, staging, final, entries, info, replace=replace)


def _read(
    fn: str, directory: Path, manifest: dict[str, Any], stem: str
) -> tuple[Any, dict[str, Any]]:
    json_rel, st_rel = f"{stem}.json", f"{stem}.safetensors"
    for rel in (json_rel, st_rel):
        if manifests.expected(manifest, rel) is None:
            raise ValueError(
                f"{fn}: {str(directory)!r} holds no {rel!r} (saved objects: "
                f"{sorted(manifest.get('objects', {}))}); pass the names used at save time."
            )
    path = directory / json_rel
    raw = path.read_bytes()
    expect = manifests.expected(manifest, json_rel)
    assert expect is not None, "checked above"
    manifests.check_sum(fn, path, expect, len(raw), zlib.crc32(raw))
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError(f"{fn}: {str(path)!r} is not JSON.") from None
    if not isinstance(doc, dict) or "state" not in doc:
        raise ValueError(
            f"{fn}: {str(path)!r} is not an accel state file (a JSON object with a 'state' "
            "key); the checkpoint was damaged or written by something else. Load an earlier "
            "checkpoint."
        )
    # A module's weights are copied into its parameters at once; other objects keep theirs.
    private = doc.get("kind") != "module"
    tensors = read_file(fn, directory / st_rel, manifests.expected(manifest, st_rel), copy=private)
    try:
        return decode(fn, doc["state"], tensors), doc
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(
            f"{fn}: {str(path)!r} describes a state accel cannot rebuild ({err}); the "
            "checkpoint was damaged or written by something else. Load an earlier checkpoint."
        ) from None


def _prepare(fn: str, kind: str, obj: Any, state: Any) -> Any:
    """Check a module's (or engine's) state against it before anything is loaded; return it."""
    if kind == "module":
        return check_against_model(fn, unwrap_model(obj), state, strict=True)
    if isinstance(obj, EngineState):  # its stage and world size, before any object changes
        obj.check(state)
    return state


def _apply(kind: str, obj: Any, state: Any) -> None:
    if kind == "module":
        load_full_state(unwrap_model(obj), state, strict=True)
    elif kind == "generator":
        obj.set_state(state["state"].clone())  # torch reads a view's storage from offset 0
    else:
        obj.load_state_dict(state)


def load(
    fn: str, ctx: RunContext, directory: Path, objects: dict[str, Any], group: Any
) -> dict[str, Any]:
    """Verify every file, then load every object; returns the manifest.

    Nothing is changed until every file passed its size, checksum and header checks, so a
    corrupt file leaves the objects (and the RNG states) as they were.
    """
    manifest = manifests.read_manifest(fn, directory)
    for rel in manifest["files"]:  # a file linked from outside the checkpoint is never read
        check_inside(fn, directory / rel, directory)
    plan = classify(fn, objects, frozenset(manifest.get("dcp", ())))
    todo: list[tuple[str, Any, Any]] = []
    grads: list[tuple[Any, dict[str, torch.Tensor] | None]] = []
    try:
        for name, kind in plan.kinds:
            obj, stem, as_kind = objects[name], name, kind
            if kind == "per_rank":
                obj, stem = _unwrapped(obj), f"{name}/rank{ctx.rank}"
                as_kind = _kind(obj)
            state, _ = _read(fn, directory, manifest, stem)
            todo.append((as_kind, obj, _prepare(fn, as_kind, obj, state)))
            if kind == "module":
                grads.append((obj, _read_grads(fn, ctx, directory, manifest, name, obj)))
        if plan.dcp_models:
            _verify_dcp(fn, directory, manifest)
        dcp_grads = [
            (m, _read_grads(fn, ctx, directory, manifest, n, m)) for n, m in plan.dcp_models
        ]
        rng = _read_rng(fn, ctx, directory, manifest)
    except FileNotFoundError as err:
        if directory.is_dir():
            raise FileNotFoundError(
                f"{fn}: {str(directory)!r} lacks {err.filename!r}, which its manifest lists; "
                "the checkpoint is incomplete. Load an earlier checkpoint."
            ) from err
        raise FileNotFoundError(
            f"{fn}: {str(directory)!r} was deleted while it was read: a newer save rotated it "
            "away. Call accel.latest_checkpoint(root) again and load that one."
        ) from err
    for kind, obj, state in todo:
        _apply(kind, obj, state)
    for model, saved in grads:
        _apply_grads(model, saved)
    if plan.dcp_models:
        models = dict(plan.dcp_models)
        optimizers = {n: (o, m) for n, o, m in plan.dcp_optimizers}
        flat = manifest.get("dcp_flat_optimizer") is True
        _dcp.load(directory, models, optimizers, group, flat=flat)
    for model, saved in dcp_grads:
        restore_window_grads(fn, model, saved or {})
    if rng is not None:
        set_rng_state(rng)
    elif ctx.seed is not None:  # a rank the saved run did not have: seeded from the run seed
        set_seed(ctx.seed, ctx=ctx)
    else:
        warnings.warn(
            f"{fn}: {str(directory)!r} was saved by {manifest.get('world_size')} ranks and has "
            f"no RNG state for rank {ctx.rank}; this rank keeps its current RNG state. Give the "
            "run a seed (init_distributed(seed=...)) to seed such ranks from it.",
            stacklevel=3,
        )
    return manifest


def _read_grads(
    fn: str, ctx: RunContext, directory: Path, manifest: dict[str, Any], name: str, model: Any
) -> dict[str, torch.Tensor] | None:
    """This rank's gradients of `model` as saved (None: saved without any), verified."""
    params = dict(unwrap_model(model).named_parameters())
    stem = _grad_stem(name, ctx.rank)
    saved = any(rel.startswith(f"{name}/{GRADS}-rank") for rel in manifest["files"])
    if saved and manifest.get("world_size") != ctx.world_size:
        raise ValueError(
            f"{fn}: {str(directory)!r} holds the gradients {name!r} accumulated on "
            f"world_size={manifest.get('world_size')} ranks inside an accumulation window, but "
            f"this run has world_size={ctx.world_size}; each rank's partial sums cannot be "
            "split another way. Resume at the saved world size, or save after an optimizer step."
        )
    if manifests.expected(manifest, f"{stem}.json") is None:
        return None
    grads, _ = _read(fn, directory, manifest, stem)
    unknown = sorted({k.removeprefix(UNSHARDED) for k in grads} - set(params))
    if unknown:
        raise ValueError(
            f"{fn}: {str(directory / stem)!r} holds gradients of parameters {unknown[:5]} that "
            f"{name!r} does not have; load it into the model it was saved from."
        )
    return dict(grads)


def _apply_grads(model: Any, grads: dict[str, torch.Tensor] | None) -> None:
    """Give the model the gradients it had when saved: this rank's sums, or none."""
    for n, p in unwrap_model(model).named_parameters():
        g = None if grads is None else grads.get(n)  # saved without: stale ones must not survive
        if g is None:
            p.grad = None
        elif p.grad is not None and p.grad.shape == g.shape:
            p.grad.copy_(g)  # keep the tensor DDP may use as a bucket view
        else:
            p.grad = g.to(device=p.device, dtype=p.dtype)


def _verify_dcp(fn: str, directory: Path, manifest: dict[str, Any]) -> None:
    for rel in manifest["files"]:
        if rel.startswith(f"{_dcp.DCP_DIR}/"):
            manifests.check_file(fn, directory / rel, manifest, rel)


def _read_rng(fn: str, ctx: RunContext, directory: Path, manifest: dict[str, Any]) -> Any:
    stem = f"{RNG}/rank{ctx.rank}"
    if manifests.expected(manifest, f"{stem}.json") is None:
        return None
    state, _ = _read(fn, directory, manifest, stem)
    # torch.set_rng_state reads a view's storage from offset 0: give it tensors of their own.
    return _own_memory(state)


def _own_memory(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _own_memory(v) for k, v in tree.items()}
    return tree
