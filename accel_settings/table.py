"""The table: every section, in help order, and the one reading of a section's values.

`read` gives what a launch config asks for, field by field, each value read by its row's
parser; a field built from several rows (`Parallelism`, `FSDPOptions`) comes as its parts,
which accel composes into the value (`accel._settings.table`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from accel_settings import compile, core, deepspeed, fp8, fsdp, mesh
from accel_settings._rows import Section, Setting
from accel_settings.values import typed_section

__all__ = ["CORE", "KEYS", "PARTS", "SECTIONS", "SETTINGS", "TABLE", "read", "section_keys"]

TABLE: tuple[Section, ...] = tuple(
    sorted(
        (core.SECTION, mesh.SECTION, fsdp.SECTION, deepspeed.SECTION, fp8.SECTION,
         compile.SECTION),
        key=lambda s: s.order,
    )
)  # fmt: skip
"""Every section of the table, in help order (the core, the top-level keys, last)."""
CORE = core.SECTION
SECTIONS: Mapping[str, Section] = MappingProxyType({s.name: s for s in TABLE if s.name})
"""The YAML sections (`fsdp_config`, ...) by name."""
KEYS: Mapping[str, Setting] = MappingProxyType(
    {s.key: s for s in CORE.settings if s.key is not None}
)
"""The top-level settings by YAML key (the sections are keys of their own)."""
SETTINGS: tuple[Setting, ...] = tuple(s for section in TABLE for s in section.settings)
"""Every setting, section by section."""
PARTS: frozenset[str] = frozenset(s.field for s in SETTINGS if s.field and s.part)
"""The fields whose value is built from several rows' parts (parallelism, fsdp)."""


def section_keys(name: str, *, flags: bool = False) -> tuple[str, ...]:
    """The keys a YAML section takes; with `flags`, those `accel launch` takes as flags."""
    settings = SECTIONS[name].settings
    return tuple(s.key for s in settings if s.key is not None and (s.flag or not flags))


def read_section(section: Section, config: Any) -> dict[str, Any]:
    """The fields `section` gives a `Config`: each row's value, read by its parser, in its
    field (a composed field as {part: value}), then the section's rules."""
    if section is CORE:  # a Config's top-level values were read by their rows already
        values = {s.key: getattr(config, s.key) for s in section.settings if s.key is not None}
    else:
        pairs = getattr(config, section.name)
        if (
            section.strategy is not None
            and pairs
            and config.distributed_type != section.strategy[0]
        ):
            kind, flag = section.strategy
            raise ValueError(
                f"config: {section.name} is given but distributed_type="
                f"{config.distributed_type!r}; set distributed_type: {kind} (or {flag}), or "
                f"remove {section.name}."
            )
        values = typed_section(section, pairs)
    found: dict[str, Any] = {}
    for setting in section.settings:
        value = values.get(str(setting.key))
        if setting.field is None or setting.key not in values or value is None or value == ():
            continue  # a launcher-only or checked-only key, or unset
        if setting.part is None:
            found[setting.field] = value
        else:
            found.setdefault(setting.field, {})[setting.part] = value
    return section.rules(values, found, config) if section.rules else found


def read(config: Any) -> dict[str, Any]:
    """Every field a `Config` asks for, section by section: the core first, so a section's
    value refines the top-level one (deepspeed_config's gradient_accumulation_steps)."""
    found: dict[str, Any] = {}
    for section in (CORE, *(s for s in TABLE if s is not CORE)):
        for field, value in read_section(section, config).items():
            if field in PARTS and field in found:
                value = {**found[field], **value}
            found[field] = value
    return found
