"""The words accel's settings table is written in, and the reader of its declarations.

The table (`accel/config/`) declares every launch setting once: its YAML key, flag, value type,
default, `RunContext` field, `ACCEL_*` variable, the variable Accelerate's launcher exports and
its help line. The declarations live in modules named `_settings*.py` (the core ones in
`accel/config/`, each strategy's in its own package) that import only the standard library and
this module, so the `accel` command reads them, to build `accel launch`'s flags and help,
without importing `accel` (and torch); `accel.config` reads the same files the same way.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Section", "Setting", "accel_root", "load_sections"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One launch setting, from its flag to its `RunContext` field."""

    key: str | None
    """The YAML key (accel's and Accelerate's spelling) and the flag `--key`; None for a
    setting only a variable carries (FSDPOptions.param_dtype)."""
    kind: str
    """The value type: names one parser of `accel._settings.values` (bool, count, precision...)."""
    help: str
    """The help line of the flag (and of `accel config --show`)."""
    default: Any = None
    """The value when nothing sets it."""
    field: str | None = None
    """The RunContext field it sets, or None for a launcher-only setting (num_processes)."""
    part: str | None = None
    """The attribute of `field`'s value it sets, when the section composes that value from
    several settings (FSDPOptions.offload_params, Parallelism.tp)."""
    env: str | None = None
    """The variable `accel launch` writes for the workers (`ACCEL_*`, or OMP_NUM_THREADS)."""
    accelerate_env: str | None = None
    """The variable Accelerate's launcher exports for it (what `Accelerator()` reads)."""
    accelerate_case: str = ""
    """How Accelerate's launcher spells the value in that variable: "", "upper" or "lower"."""
    flags: tuple[str, ...] = ()
    """Other spellings of the flag (`cpu` for use_cpu, `tp_size`), listed in help as aliases."""
    flag: bool = True
    """Whether `accel launch` takes it as `--key` (False: YAML only, or another flag's)."""
    group: str = ""
    """The help group of its flag, when not its section's title."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """The settings of one YAML section (`fsdp_config`), or the top-level keys (name "")."""

    name: str
    """The YAML key holding the section ("" for the top-level keys)."""
    title: str
    """The help group of its flags in `accel launch --help`."""
    description: str
    """The help group's description."""
    settings: tuple[Setting, ...]
    """The section's settings, in help order."""
    shown_with: str | None = None
    """A flag that shows this group in `accel launch --help` (use_fsdp), as Accelerate does."""
    order: int = 50
    """Where the help group stands among the others (lower first)."""
    env_prefix: str | None = None
    """A prefix every variable of the section starts with: an unknown one is refused."""
    accelerate_switch: tuple[tuple[str, str], ...] = ()
    """Variables Accelerate's launcher exports when the section is in use (ACCELERATE_USE_FSDP)."""
    active: Callable[[Any], bool] | None = None
    """Whether a `Config` uses the section (its Accelerate variables are exported then)."""
    build: Callable[[Any], dict[str, Any]] | None = None
    """The RunContext values the section gives a `Config` (`field` -> value), checked."""
    compose: Callable[[str, dict[str, Any]], Any] | None = None
    """Builds a field's value from its parts (FSDPOptions from ACCEL_FSDP_*): field, parts."""


def load_sections(root: str | os.PathLike[str]) -> tuple[Section, ...]:
    """Every `SECTION` declared in `root`'s `*/_settings*.py` modules, in help order.

    Each module is read from its file under a name of its own, so no package of `root` (and
    nothing it imports) is imported: declarations import only the standard library and this.
    """
    found = []
    for folder in sorted(os.listdir(root)):
        directory = os.path.join(root, folder)
        if folder.startswith((".", "__")) or not os.path.isdir(directory):
            continue
        for file in sorted(os.listdir(directory)):
            if file.startswith("_settings") and file.endswith(".py"):
                found.append(_load(os.path.join(directory, file), f"{folder}.{file[:-3]}"))
    return tuple(sorted(found, key=lambda s: s.order))


def _load(path: str, name: str) -> Section:
    name = f"accel_cli._declared.{name}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look a class's module up by name
        spec.loader.exec_module(module)
    section: Section = module.SECTION
    return section


def accel_root() -> str:
    """The folder of the installed `accel` package, found without importing it."""
    spec = importlib.util.find_spec("accel")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("accel: the package is not installed next to accel_cli.")
    return str(next(iter(spec.submodule_search_locations)))
