"""One parser per value type of the settings table (a `Setting.kind`), and its spelling in a
variable. Each parser takes what YAML gives (booleans, ints) or the text of a flag or an
`ACCEL_*` variable ("true", "2"), and refuses anything else naming the key and what is allowed.
The launcher and the workers read every value through these parsers: one set of rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeAlias, cast, get_args

from accel_settings._rows import Section as Rows
from accel_settings.tracker_names import check_tracker_name

Section = tuple[tuple[str, Any], ...]
"""A YAML section as sorted (key, value) pairs: immutable, and in one order."""

Precision: TypeAlias = Literal["fp32", "bf16", "fp16", "fp8"]
"""Mixed-precision mode: fp32 weights always; bf16/fp16 name the autocast compute dtype; fp8
is torchao's float8 training of the Linear layers with bf16 autocast around the rest."""

CompileMode = Literal[False, True, "regional"]
"""What wrap_model compiles: nothing, the whole model, or each repeated block."""


def check_compile(fn: str, value: Any, *, name: str = "compile") -> CompileMode:
    """The one validator of a compile setting: False, True or "regional" (not 0, 1 or "yes")."""
    if value is False or value is True or value == "regional":
        return cast(CompileMode, value)
    raise ValueError(
        f"{fn}: {name}={value!r} must be False, True or 'regional'; False does not compile, "
        "True compiles the whole model, 'regional' each repeated block. Use compile=True."
    )


# Accelerate's `distributed_type` values that accel runs, and the ones it refuses with a reason.
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED")
UNSUPPORTED_TYPES = MappingProxyType(
    {
        "MEGATRON_LM": "accel does not wrap Megatron-LM",
        "XLA": "accel runs on torch.distributed backends (gloo, nccl), not XLA",
        "TPU": "accel runs on torch.distributed backends (gloo, nccl), not XLA",
        "MULTI_NPU": "accel supports cpu, cuda and mps devices",
        "MULTI_XPU": "accel supports cpu, cuda and mps devices",
        "MULTI_MLU": "accel supports cpu, cuda and mps devices",
    }
)


def _written(value: Any, kind: type[int] | type[float]) -> Any:
    """`value`, or the number a string writes (a flag, a variable); None for other strings."""
    if not isinstance(value, str):
        return value
    try:
        return kind(value)
    except ValueError:
        return None


def _integer(fn: str, key: str, value: Any, minimum: int, *, fill: bool = False) -> int:
    number = _written(value, int)
    ok = isinstance(number, int) and not isinstance(number, bool)
    if not ok or (number < minimum and not (fill and number == -1)):
        allowed = f">= {minimum}" + (" or -1 (fill)" if fill else "")
        raise ValueError(
            f"{fn}: {key}={value!r} must be an integer {allowed}. Fix the value in the config "
            "file, the flag or the variable."
        )
    return cast(int, number)


def _bool(fn: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{fn}: {key}={value!r} must be true or false.")


def _optional_bool(fn: str, key: str, value: Any) -> bool | None:
    return None if value is None or value == "" else _bool(fn, key, value)


def _text(fn: str, key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ValueError(f"{fn}: {key}={value!r} must be a string.")
    return str(value)


def _float(fn: str, key: str, value: Any) -> float:
    number = _written(value, float)
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not math.isfinite(number)
        or number <= 0
    ):
        raise ValueError(f"{fn}: {key}={value!r} must be a finite number > 0, e.g. 0.1.")
    return float(number)


def _port(fn: str, key: str, value: Any) -> int | None:
    if value is None:
        return None
    number = _integer(fn, key, value, 0) if not isinstance(value, bool) else -1
    if not 0 <= number <= 65535:
        raise ValueError(
            f"{fn}: {key}={value!r} is not a TCP port; expected an integer in [0, 65535] "
            "(0 picks a free port on a single machine)."
        )
    return number


# What torch's c10d rendezvous reads from --rdzv-conf (torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py `create_handler`, c10d_rendezvous_backend.py `_create_tcp_store` and
# `create_backend`; `timeout` is torch.distributed.launcher.api's), by value type.
RDZV_CONF_KEYS = MappingProxyType(
    {
        "join_timeout": "seconds", "last_call_timeout": "seconds", "close_timeout": "seconds",
        "heartbeat_timeout": "seconds", "read_timeout": "seconds", "timeout": "seconds",
        "keep_alive_interval": "seconds", "keep_alive_max_attempt": "count",
        "is_host": "bool", "store_type": "store",
    }
)  # fmt: skip


def _rdzv_conf(fn: str, key: str, value: Any) -> str | None:
    """torchrun's --rdzv-conf text, "k1=v1,k2=v2", each key one c10d reads, each value valid."""
    if value is None or value == "":
        return None
    pairs: list[str] = value.split(",") if isinstance(value, str) else [""]
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name:
            raise ValueError(
                f"{fn}: {key}={value!r} must be 'key=value' pairs separated by commas, e.g. "
                "join_timeout=60,last_call_timeout=5."
            )
        kind = RDZV_CONF_KEYS.get(name)
        if kind is None:
            raise ValueError(
                f"{fn}: {key} has unknown key {name!r}; torch's c10d rendezvous reads "
                f"{sorted(RDZV_CONF_KEYS)}. Remove or rename it."
            )
        ok = {
            "seconds": text.isdigit() and int(text) > 0,
            "count": text.isdigit() and int(text) > 0,
            "bool": text.lower() in ("true", "false", "1", "0"),
            "store": text.lower() in ("tcp", "file"),
        }[kind]
        if not ok:
            allowed = {"seconds": "a whole number of seconds > 0", "count": "an integer > 0",
                       "bool": "true or false", "store": "tcp or file"}[kind]  # fmt: skip
            raise ValueError(f"{fn}: {key}: {name}={text!r} must be {allowed}.")
    return ",".join(p.strip() for p in value.split(","))


def _distributed_type(fn: str, key: str, value: Any) -> str:
    text = str(value).upper()
    if text in UNSUPPORTED_TYPES:
        raise NotImplementedError(f"{fn}: {key}={value!r}: {UNSUPPORTED_TYPES[text]}.")
    if text not in DISTRIBUTED_TYPES:
        raise ValueError(
            f"{fn}: {key}={value!r} is not known; expected one of {DISTRIBUTED_TYPES}."
        )
    return text


def _precision(fn: str, key: str, value: Any) -> Precision:
    # YAML reads a bare `no` as False, which is how Accelerate's files spell "no mixed precision".
    text = "fp32" if value is False or value in ("no", "fp32", None) else value
    if text not in get_args(Precision):
        raise ValueError(
            f"{fn}: {key}={value!r} is not a precision; expected one of "
            f"{get_args(Precision)} (or Accelerate's 'no'). Example: mixed_precision: bf16"
        )
    return cast(Precision, text)


def _names(fn: str, key: str, value: Any) -> tuple[str, ...]:
    """Tracker names: a list, or one comma-separated string."""
    if value is None or value == "":
        return ()
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ValueError(
            f"{fn}: {key}={value!r} must be a list of tracker names or 'wandb,mlflow'."
        )
    parsed = tuple(
        check_tracker_name(f"{fn}: {key}", n.strip() if isinstance(n, str) else n) for n in names
    )
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"{fn}: {key}={value!r} repeats a tracker name; list each once.")
    return parsed


def _class_names(fn: str, key: str, value: Any) -> tuple[str, ...]:
    listed = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return tuple(str(n).strip() for n in listed if str(n).strip())


def _section(fn: str, key: str, value: Any) -> Section:
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):  # pairs: a Config turned back into a mapping
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{fn}: {key}={value!r} must be a mapping of keys to values.")
    return tuple(sorted(value.items()))


def _json_section(fn: str, key: str, value: Any) -> Section:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(
                f"{fn}: {key} must be a JSON object of Accelerate's deepspeed_config keys "
                "(accel launch writes it); unset it."
            )
    return _section(fn, key, value)


def _compile(fn: str, key: str, value: Any) -> Any:
    if isinstance(value, str):
        value = {"false": False, "true": True}.get(value.lower(), value)
    return check_compile(fn, value, name=key)


def _choice(allowed: tuple[str, ...]) -> Callable[[str, str, Any], str]:
    def parse(fn: str, key: str, value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"{fn}: {key}={value!r} is not allowed; expected one of {allowed}.")
        return str(value)

    return parse


def _auto(parse: Callable[[str, str, Any], Any]) -> Callable[[str, str, Any], Any]:
    """`parse`, or "auto" (DeepSpeed fills it from the run)."""

    def parse_or_auto(fn: str, key: str, value: Any) -> Any:
        return "auto" if value == "auto" else parse(fn, key, value)

    return parse_or_auto


def _zero_stage(fn: str, key: str, value: Any) -> int:
    stage = _integer(fn, key, value, 0)
    if stage > 3:
        raise ValueError(f"{fn}: {key}={value!r} is not a ZeRO stage; expected 0, 1, 2 or 3.")
    return stage


PARSERS: Mapping[str, Callable[[str, str, Any], Any]] = MappingProxyType(
    {
        "bool": _bool,
        "optional_bool": _optional_bool,
        "count": lambda fn, k, v: _integer(fn, k, v, 1),
        "index": lambda fn, k, v: _integer(fn, k, v, 0),
        "optional_count": lambda fn, k, v: None if v is None else _integer(fn, k, v, 1),
        "optional_index": lambda fn, k, v: None if v is None else _integer(fn, k, v, 0),
        "mesh_size": lambda fn, k, v: _integer(fn, k, v, 1, fill=True),
        "float": _float,
        "text": _text,
        "port": _port,
        "rdzv_backend": _choice(("static", "c10d")),
        "rdzv_conf": _rdzv_conf,
        "distributed_type": _distributed_type,
        "precision": _precision,
        "names": _names,
        "class_names": _class_names,
        "section": _section,
        "json_section": _json_section,
        "compile": _compile,
        "zero_stage": _zero_stage,
        "offload_device": _choice(("none", "cpu", "nvme")),
        "auto_count": _auto(lambda fn, k, v: _integer(fn, k, v, 1)),
        "auto_float": _auto(_float),
        "any": lambda fn, k, v: v,  # checked by its row's `allowed` or its section's rules
    }
)


def parse(kind: str, key: str, value: Any, *, fn: str = "config") -> Any:
    """The value of a setting of type `kind`, checked; `fn` names the caller in errors.

    Example:
        >>> parse("precision", "mixed_precision", "no")
        'fp32'
    """
    return PARSERS[kind](fn, key, value)


def spell(kind: str, value: Any) -> str:
    """A value as a variable carries it ("" for none): the text `parse` reads back.

    Example:
        >>> spell("names", ("wandb", "mlflow")), spell("bool", True)
        ('wandb,mlflow', 'true')
    """
    if value is None:
        return ""
    if kind == "json_section":
        return json.dumps(dict(value))
    if isinstance(value, (tuple, list)):
        return ",".join(c if isinstance(c, str) else c.__name__ for c in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).removeprefix("torch.")  # a dtype by its name: "bfloat16"


def refuse(key: str, value: Any, why: str, *, fn: str = "config") -> None:
    """Refuse a value accel cannot honour, naming the key and the reason."""
    raise NotImplementedError(f"{fn}: {key}={value!r} is not supported: {why}.")


def allow(key: str, value: Any, allowed: tuple[Any, ...], why: str, *, fn: str = "config") -> None:
    """Refuse `value` unless it spells one of `allowed` (case-insensitive)."""
    if str(value).lower() not in {str(a).lower() for a in allowed}:
        refuse(key, value, why, fn=fn)


def typed_section(section: Rows, pairs: Any, *, fn: str = "config") -> dict[str, Any]:
    """A YAML section's values (a mapping or pairs), each read by its row's parser and checked
    against its row's `allowed`; a key the section does not declare is refused."""
    values = dict(pairs)
    keys = tuple(s.key for s in section.settings if s.key is not None)
    typed: dict[str, Any] = {}
    prefix = section.key_prefix
    for given, value in values.items():
        key = given if given in keys or not prefix else f"{prefix}{given}"
        if key not in keys:
            known = sorted(k.removeprefix(prefix) for k in keys)
            raise ValueError(
                f"{fn}: {section.name} has unknown key {given!r}; accel knows {known}. "
                "Remove it, or rename it to one of those."
            )
        row = section.row(key)
        if row.allowed is not None:
            allow(key, value, *row.allowed, fn=fn)
        typed[key] = parse(row.kind, key, value, fn=fn)
    return typed
