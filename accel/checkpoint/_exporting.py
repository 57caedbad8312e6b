"""`save_model`'s work: a model's weights to the Hugging Face layout, in a folder or a store.

Unsharded, rank 0 writes the files (a sharded model gathered first with full_state_dict); sharded
(FSDP2, tensor parallel), every rank writes its own slices into place (`_sharded_save`). To a
store, the export is written into a local folder first (rank 0's, which the ranks of its
machine share; others stream to rank 0) and uploaded by rank 0 with the manifest last.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import nn

from accel._dtensor import has_dtensors
from accel._groups import every_rank_step
from accel._store.exports import publish_export
from accel._store.staging import new_folder
from accel._store.staging import remove as remove_folder
from accel._store.transfer import listing
from accel._store.urls import Remote
from accel.checkpoint._deepspeed_state import engine_state
from accel.checkpoint._model_io import (
    dedupe_tied,
    file_layout,
    publish_model_files,
    write_model_files,
)
from accel.checkpoint._sharded_save import save_sharded
from accel.context import RunContext
from accel.parallel import unwrap_model
from accel.parallel.deepspeed import deepspeed_engine

_FN = "save_model"


def export(
    ctx: RunContext, model: nn.Module, directory: Path, max_bytes: int, full_state_dict: bool
) -> None:
    """Write `model`'s weights into the local `directory`; every rank returns once durable."""
    fn = _FN
    inner = unwrap_model(model)
    engine = deepspeed_engine(model)  # its whole weights on every rank (ZeRO-3 gathers them)
    state = inner.state_dict() if engine is None else engine_state(engine)
    if has_dtensors(state.values()) and not full_state_dict:  # no rank gathers anything
        tensors, aliases = dedupe_tied(inner.state_dict(keep_vars=True))  # ties by identity
        publish = partial(publish_model_files, fn, directory, tensors, aliases, max_bytes)
        save_sharded(ctx, directory, file_layout(tensors, max_bytes), publish)
        return
    if has_dtensors(state.values()):
        from torch.distributed.checkpoint.state_dict import (  # on use: ~1 s to import
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(inner, options=options)

    def write() -> None:
        if ctx.is_main:
            write_model_files(directory, state, max_bytes)

    every_rank_step(ctx, fn, write)  # every rank returns once the files are durable, or raises


def export_to_store(
    ctx: RunContext, model: nn.Module, where: Remote, max_bytes: int, full_state_dict: bool
) -> None:
    """Write `model`'s weights to the store prefix `where` (`publish_export`: the manifest is
    uploaded last); every rank returns once it is committed."""
    fn = _FN

    def make() -> str | None:  # the store is asked first: a missing bucket costs no write
        if not ctx.is_main:
            return None
        listing(fn, where)
        return str(new_folder("upload"))

    folder = Path(str(every_rank_step(ctx, fn, make)[0]))
    try:
        export(ctx, model, folder, max_bytes, full_state_dict)
        every_rank_step(ctx, fn, lambda: publish_export(fn, folder, where) if ctx.is_main else None)
    finally:
        if ctx.is_main:
            remove_folder(folder)
