"""The settings table and the loops over it: a `Config` to RunContext values, those values to
the workers' variables and back, and Accelerate's variables.

Every setting is declared once, in a `_settings*.py` module (the core ones beside this file,
each strategy's in its package); nothing here names a setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from accel._settings.values import parse, spell
from accel_cli._setting import Section, Setting, load_sections

TABLE: tuple[Section, ...] = load_sections(Path(__file__).parent.parent)  # accel/
"""Every section of the table, in help order (the core, the top-level keys, last)."""
CORE = next(s for s in TABLE if s.name == "")
SECTIONS: Mapping[str, Section] = MappingProxyType({s.name: s for s in TABLE if s.name})
"""The YAML sections (`fsdp_config`, ...) by name."""
KEYS: Mapping[str, Setting] = MappingProxyType(
    {s.key: s for s in CORE.settings if s.key is not None}
)
"""The top-level settings by YAML key (the sections are keys of their own)."""
SETTINGS: tuple[Setting, ...] = tuple(s for section in TABLE for s in section.settings)
"""Every setting, section by section."""


def section_keys(name: str, *, flags: bool = False) -> tuple[str, ...]:
    """The keys a YAML section takes; with `flags`, those `accel launch` takes as flags."""
    settings = SECTIONS[name].settings
    return tuple(s.key for s in settings if s.key is not None and (s.flag or not flags))


def build(config: Any) -> dict[str, Any]:
    """The RunContext values a `Config` asks for, each section checking its own keys.

    The core (top-level keys) first: a section's value refines the top-level one it names (a
    deepspeed_config's gradient_accumulation_steps is the run's when the top-level key is 1).
    """
    found: dict[str, Any] = {}
    for section in (CORE, *(s for s in TABLE if s is not CORE)):
        assert section.build is not None, section.name
        found.update(section.build(config))
    return found


def environment(settings: Mapping[str, Any], config: Any) -> dict[str, str]:
    """The variables that carry `settings` (RunContext values) and `config`'s launcher-only
    settings (gpu_ids, threads) to every worker."""
    env: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.env is None:
            continue
        if setting.field is None:  # read by torch or CUDA in the worker, not by accel
            value = getattr(config, str(setting.key))
            text = "" if value == setting.default else spell(setting.kind, value)
        elif setting.field in settings:
            value = settings[setting.field]
            text = spell(setting.kind, getattr(value, setting.part) if setting.part else value)
        else:
            continue
        if text:
            env[setting.env] = text
    return env


def read_environment(environ: Mapping[str, str], fn: str) -> dict[str, tuple[Any, str]]:
    """The RunContext values found in `environ`, each with its source ("env ACCEL_SEED")."""
    found: dict[str, tuple[Any, str]] = {}
    parts: dict[str, dict[str, Any]] = {}
    names: dict[str, list[str]] = {}
    for section in TABLE:
        if section.env_prefix:
            declared = {s.env for s in section.settings}
            for var in sorted(environ):
                if var.startswith(section.env_prefix) and var not in declared:
                    raise ValueError(
                        f"{fn}: {var} is not a setting; expected one of "
                        f"{sorted(str(v) for v in declared if v)}. Unset it."
                    )
    for setting in SETTINGS:
        if setting.env is None or setting.field is None or setting.env not in environ:
            continue
        value = parse(setting.kind, setting.env, environ[setting.env], fn=fn)
        if setting.part is None:
            found[setting.field] = (value, f"env {setting.env}")
        else:
            parts.setdefault(setting.field, {})[setting.part] = value
            names.setdefault(setting.field, []).append(setting.env)
    for field, values in parts.items():
        section = next(s for s in TABLE if any(x.field == field and x.part for x in s.settings))
        listed = sorted(names[field]) if section.env_prefix else names[field]
        source = "env " + ", ".join(listed)
        assert section.compose is not None, field
        try:
            found[field] = (section.compose(field, values), source)
        except ValueError as err:  # e.g. two mesh sizes of -1
            raise ValueError(f"{fn}: {', '.join(listed)}: {err}") from None
    return found


def _accelerate_text(setting: Setting, value: Any) -> str:
    if isinstance(value, bool):
        text = str(value) if setting.accelerate_case == "title" else str(value).lower()
    elif isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    elif setting.kind == "precision":
        text = "no" if value == "fp32" else str(value)
    else:
        text = str(value)
    case = setting.accelerate_case
    return text.upper() if case == "upper" else text.lower() if case == "lower" else text


def accelerate_variables(config: Any) -> dict[str, str]:
    """The variables Accelerate's own launcher exports for `config` (accelerate/utils/launch.py,
    1.15), so code built on Accelerate sees what was asked."""
    env: dict[str, str] = {}
    for setting in CORE.settings:
        if setting.accelerate_env is not None:
            env[setting.accelerate_env] = _accelerate_text(
                setting, getattr(config, str(setting.key))
            )
    for section in TABLE:
        if section.active is None or not section.active(config):
            continue
        env.update(section.accelerate_switch)
        declared = {s.key: s for s in section.settings if s.key is not None}
        for key, value in getattr(config, section.name, ()):
            found = declared.get(key)
            if found is not None and found.accelerate_env is not None:
                env[found.accelerate_env] = _accelerate_text(found, value)
    return env
