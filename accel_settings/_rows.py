"""The words the settings table is written in: a `Setting` (one row) and a `Section` (a YAML
section's rows and its rules)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Section", "Setting"]

Rules = Callable[[Mapping[str, Any], Mapping[str, Any], Any], dict[str, Any]]
"""A section's rules, for what is more than one row -> one field: (its values by key, typed by
their rows; the fields its rows gave, a composed field as its parts; the whole Config) -> the
fields it gives (a value two keys decide, a default another key implies). It may refuse a
combination, naming the keys."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One launch setting, from its flag to the field of the worker's `RunContext` it fills."""

    key: str | None
    """The YAML key (accel's and Accelerate's spelling) and the flag `--key`; None for a
    setting only a variable carries (FSDPOptions.param_dtype)."""
    kind: str
    """The value type: names one parser of `accel_settings.values` (bool, count, precision...)."""
    help: str
    """The help line of the flag (and of `accel config --show`)."""
    default: Any = None
    """The value when nothing sets it."""
    field: str | None = None
    """The field it fills: one of RunContext's or of its `wrap` (WrapDefaults); None for a
    launcher-only setting (num_processes) or a key that is only checked (fsdp_version)."""
    part: str | None = None
    """The attribute of `field`'s value it sets, when that value is built from several rows
    (FSDPOptions.offload_params, Parallelism.tp)."""
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
    allowed: tuple[tuple[Any, ...], str] | None = None
    """For a key accel accepts only at the value it already applies: (the values, why), so
    another value is refused naming the key and the reason (fsdp_version: only 2)."""
    per_machine: bool = False
    """A machine's own value (its rank, its GPUs, how it names machine 0): `accel launch` on
    several machines compares every other setting across the machines before training."""


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
    strategy: tuple[str, str] | None = None
    """(distributed_type, flag) of a strategy's section: its keys are refused in a run of
    another type (fsdp_config without distributed_type FSDP)."""
    accelerate_switch: tuple[tuple[str, str], ...] = ()
    """Variables Accelerate's launcher exports when the section is in use (ACCELERATE_USE_FSDP)."""
    active: Callable[[Any], bool] | None = None
    """Whether a `Config` uses the section (its Accelerate variables are exported then)."""
    key_prefix: str = ""
    """A prefix YAML may leave off its keys (fp8_config's `backend` is `--fp8_backend`)."""
    rules: Rules | None = None
    """What the section decides beyond one row per field (see `Rules`)."""

    def row(self, key: str) -> Setting:
        """The row of YAML key `key`."""
        return next(s for s in self.settings if s.key == key)
