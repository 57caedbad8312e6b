"""FSDP2 (DTensor) models and their optimizers, saved sharded through torch.distributed.checkpoint.

DCP stores each rank's shards and a global `.metadata`, and reshards on load, so a checkpoint
saved at one world size loads at another (or into a plain, unsharded model in one process).
DCP writes `.metadata` with pickle; it is read here with an unpickler that only builds DCP's
own metadata classes, so a planted pickle cannot run code.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

DCP_DIR = "dcp"

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
_ALLOWED_NAMES = frozenset(
    {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"load_state: the DCP metadata asks for {module}.{name}, which is not DCP metadata; "
            "refusing to unpickle it."
        )


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            with open(self._get_metadata_path(rank), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def owner_model(optimizer: torch.optim.Optimizer, models: dict[str, nn.Module]) -> str | None:
    """The name of the model whose parameters the optimizer updates."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, model in models.items():
        if params & {id(p) for p in model.parameters()}:
            return name
    return None


def state_dicts(
    models: dict[str, nn.Module],
    optimizers: dict[str, tuple[torch.optim.Optimizer, str]],
    *,
    flat: bool = False,
) -> dict[str, Any]:
    """The DCP state of each model and optimizer, keyed by the user's names.

    `flat` stores the optimizer's hyperparameters per parameter name: pipeline stages hold
    different parameters, and a nested `param_groups` entry (one object, written by one rank)
    would only list one stage's (torchtitan flattens for the same reason).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    state: dict[str, Any] = {name: get_model_state_dict(m) for name, m in models.items()}
    for name, (opt, model_name) in optimizers.items():
        state[name] = get_optimizer_state_dict(models[model_name], opt, options=options)
    return state


def save(state: dict[str, Any], directory: Path, group: Any) -> None:
    """Write `state` sharded under `directory/dcp` (a collective over `group`)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer = FileSystemWriter(directory / DCP_DIR, sync_files=True)
    dcp_save(state, storage_writer=writer, process_group=group)


def load(
    directory: Path,
    models: dict[str, nn.Module],
    optimizers: dict[str, tuple[torch.optim.Optimizer, str]],
    group: Any,
    *,
    flat: bool = False,
) -> None:
    """Load models and optimizers from `directory/dcp`, resharding to the current layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = state_dicts(models, optimizers, flat=flat)
    with warnings.catch_warnings():
        # Loading a sharded checkpoint in one plain process is intended here, not a mistake.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, storage_reader=_reader(directory / DCP_DIR), process_group=group)
    for name, model in models.items():
        set_model_state_dict(model, state[name])
    for name, (opt, model_name) in optimizers.items():
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        set_optimizer_state_dict(models[model_name], opt, state[name], options=options)
