"""The settings table's loops: a `Config` to RunContext values, those values to the workers'
variables and back, and Accelerate's variables.

Every setting is a row of `accel_settings`; nothing here names one. A field built from several
rows (`Parallelism`, `FSDPOptions`) is composed from its parts by its type, named in `VALUES`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from accel._options import FSDPOptions
from accel._parallelism import Parallelism
from accel_settings import KEYS, TABLE, Section, Setting
from accel_settings.table import PARTS, read
from accel_settings.values import parse, spell, typed_section

VALUES: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {"parallelism": Parallelism, "fsdp": FSDPOptions}
)
"""The type of each field the table builds from parts (the rows whose `part` is set)."""
assert set(VALUES) == PARTS, "a field built from parts needs its type here"


def build(config: Any) -> dict[str, Any]:
    """The RunContext values a `Config` asks for (by field), every value checked.

    Example:
        >>> from accel.config import Config
        >>> build(Config(seed=3))["seed"]
        3
    """
    return {
        field: VALUES[field](**value) if field in VALUES else value
        for field, value in read(config).items()
    }


def _spell(section: Section, setting: Setting, value: Any) -> str:
    if setting.kind != "json_section":
        return spell(setting.kind, value)
    # A whole section, each value spelled by its own row (read back by the same rows).
    return json.dumps({k: None if v is None else spell(section.row(k).kind, v) for k, v in value})


def environment(settings: Mapping[str, Any], config: Any) -> dict[str, str]:
    """The variables that carry `settings` (RunContext values) and `config`'s launcher-only
    settings (gpu_ids, threads) to every worker."""
    env: dict[str, str] = {}
    for section in TABLE:
        for setting in section.settings:
            if setting.env is None:
                continue
            if setting.field is None:  # read by torch or CUDA in the worker, not by accel
                value = getattr(config, str(setting.key))
                text = "" if value == setting.default else spell(setting.kind, value)
            elif setting.field in settings:
                value = settings[setting.field]
                value = getattr(value, setting.part) if setting.part else value
                text = _spell(section, setting, value)
            else:
                continue
            if text:
                env[setting.env] = text
    return env


def _check_prefix(section: Section, environ: Mapping[str, str], fn: str) -> None:
    if not section.env_prefix:
        return
    declared = {s.env for s in section.settings}
    for var in sorted(environ):
        if var.startswith(section.env_prefix) and var not in declared:
            raise ValueError(
                f"{fn}: {var} is not a setting; expected one of "
                f"{sorted(str(v) for v in declared if v)}. Unset it."
            )


def read_environment(environ: Mapping[str, str], fn: str) -> dict[str, tuple[Any, str]]:
    """The RunContext values found in `environ`, each with its source ("env ACCEL_SEED"),
    read by the same rows and parsers as the launcher's config."""
    found: dict[str, tuple[Any, str]] = {}
    parts: dict[str, dict[str, Any]] = {}
    names: dict[str, list[str]] = {}
    for section in TABLE:
        _check_prefix(section, environ, fn)
        for setting in section.settings:
            if setting.env is None or setting.field is None or setting.env not in environ:
                continue
            value = parse(setting.kind, setting.env, environ[setting.env], fn=fn)
            if setting.kind == "json_section":
                value = tuple(sorted(typed_section(section, value, fn=f"{fn}: {setting.env}")
                                     .items()))  # fmt: skip
            if setting.part is None:
                found[setting.field] = (value, f"env {setting.env}")
            else:
                parts.setdefault(setting.field, {})[setting.part] = value
                names.setdefault(setting.field, []).append(setting.env)
                if section.env_prefix:  # its variables, as `env` lists them
                    names[setting.field].sort()
    for field, values in parts.items():
        listed = names[field]
        try:
            found[field] = (VALUES[field](**values), "env " + ", ".join(listed))
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
    for setting in KEYS.values():
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
