"""The `ACCEL_*` variables: what `accel launch` writes into each worker's environment for
`init_distributed` to read back (parsed here from a mapping; only `accel.config` and
`accel.distributed` read `os.environ` itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any, cast, get_args

from accel._parallelism import FSDPOptions, Parallelism, check_compile
from accel._typing import Precision

ENV_PRECISION = "ACCEL_PRECISION"
ENV_GRAD_ACCUM = "ACCEL_GRAD_ACCUM_STEPS"
ENV_SEED = "ACCEL_SEED"
ENV_DEVICE = "ACCEL_DEVICE"
ENV_CONFIG_FILE = "ACCEL_CONFIG_FILE"
ENV_COMPILE = "ACCEL_COMPILE"
ENV_ACTIVATION_CHECKPOINTING = "ACCEL_ACTIVATION_CHECKPOINTING"
ENV_FSDP_PREFIX = "ACCEL_FSDP_"
ENV_LOG_WITH = "ACCEL_LOG_WITH"
ENV_DEEPSPEED = "ACCEL_DEEPSPEED_CONFIG"  # Accelerate's deepspeed_config section, as JSON
# Trackers accel builds by name without a registry (accel.tracking.BUILTIN_TRACKERS).
BUILTIN_TRACKER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
ENV_MESH = MappingProxyType(
    {
        "pp": "ACCEL_PP_SIZE",
        "dp_replicate": "ACCEL_DP_REPLICATE_SIZE",
        "dp_shard": "ACCEL_DP_SHARD_SIZE",
        "cp": "ACCEL_CP_SIZE",
        "tp": "ACCEL_TP_SIZE",
    }
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


def parse_int(minimum: int) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"config: {key}={value!r} must be an integer >= {minimum}. Fix the value in "
                "the config file or on the command line."
            )
        return value

    return parse


def parse_optional_int(minimum: int) -> Callable[[str, Any], int | None]:
    inner = parse_int(minimum)
    return lambda key, value: None if value is None else inner(key, value)


def parse_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"config: {key}={value!r} must be true or false.")
    return value


def parse_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)):
        raise ValueError(f"config: {key}={value!r} must be a string.")
    return str(value)


def parse_distributed_type(key: str, value: Any) -> str:
    text = str(value).upper()
    if text in UNSUPPORTED_TYPES:
        raise NotImplementedError(f"config: {key}={value!r}: {UNSUPPORTED_TYPES[text]}.")
    if text not in DISTRIBUTED_TYPES:
        raise ValueError(
            f"config: {key}={value!r} is not known; expected one of {DISTRIBUTED_TYPES}."
        )
    return text


def parse_float(key: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"config: {key}={value!r} must be a finite number > 0, e.g. 0.1.")
    return float(value)


Section = tuple[tuple[str, Any], ...]


def parse_section(key: str, value: Any) -> Section:
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):  # pairs: a Config turned back into a mapping
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"config: {key}={value!r} must be a mapping of keys to values.")
    return tuple(sorted(value.items()))


def parse_port(key: str, value: Any) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535
    ):
        raise ValueError(
            f"config: {key}={value!r} is not a TCP port; expected an integer in [0, 65535] "
            "(0 picks a free port on a single machine)."
        )
    return value


def parse_precision(key: str, value: Any) -> Precision:
    """Map a precision setting (accel's or Accelerate's spelling) to a `Precision`."""
    # YAML reads a bare `no` as False, which is how Accelerate's files spell "no mixed precision".
    text = "fp32" if value is False or value in ("no", "fp32", None) else value
    if text not in get_args(Precision):
        raise ValueError(
            f"config: {key}={value!r} is not a precision; expected one of "
            f"{get_args(Precision)} (or Accelerate's 'no'). Example: mixed_precision: bf16"
        )
    return cast(Precision, text)


def check_tracker_name(function: str, name: Any) -> str:
    """`name` if it can name a tracker (a registry key or "package.module:Factory")."""
    if not isinstance(name, str) or not name or name.strip() != name or "," in name:
        raise ValueError(
            f"{function}: tracker name {name!r} is not a name; expected e.g. 'wandb' or "
            "'package.module:MyTracker'."
        )
    if name == "all":
        raise ValueError(
            f"{function}: tracker name 'all' is not supported; accel builds the trackers you "
            f"name, e.g. {list(BUILTIN_TRACKER_NAMES)}. List them."
        )
    return name


def parse_log_with(key: str, value: Any) -> tuple[str, ...]:
    """Tracker names from a config value: a list, or one comma-separated string."""
    if value is None or value == "":
        return ()
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ValueError(
            f"config: {key}={value!r} must be a list of tracker names or 'wandb,mlflow'."
        )
    parsed = tuple(
        check_tracker_name(f"config: {key}", n.strip() if isinstance(n, str) else n) for n in names
    )
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"config: {key}={value!r} repeats a tracker name; list each once.")
    return parsed


def env_settings(
    environ: Mapping[str, str], *, fn: str = "init_distributed"
) -> dict[str, tuple[Any, str]]:
    """Return the RunContext settings found in `environ`, each with its source label.

    `fn` names the caller in errors: the workers' `init_distributed`, or `accel launch`, which
    checks its own environment the same way before it starts them.
    """
    found: dict[str, tuple[Any, str]] = {}
    if ENV_PRECISION in environ:
        found["precision"] = (
            parse_precision(ENV_PRECISION, environ[ENV_PRECISION]),
            f"env {ENV_PRECISION}",
        )
    if ENV_DEVICE in environ:
        found["device"] = (environ[ENV_DEVICE], f"env {ENV_DEVICE}")
    for var, name in ((ENV_GRAD_ACCUM, "grad_accum_steps"), (ENV_SEED, "seed")):
        if var in environ:
            try:
                number = int(environ[var])
            except ValueError:
                raise ValueError(
                    f"{fn}: {var}={environ[var]!r} must be an integer; set one or unset {var}."
                ) from None
            found[name] = (number, f"env {var}")
    mesh_vars = {dim: var for dim, var in ENV_MESH.items() if var in environ}
    if mesh_vars:
        sizes = {}
        for dim, var in mesh_vars.items():
            try:
                sizes[dim] = int(environ[var])
            except ValueError:
                sizes[dim] = 0  # refused below, naming the variable
            if sizes[dim] < 1 and sizes[dim] != -1:
                raise ValueError(
                    f"{fn}: {var}={environ[var]!r} must be an integer >= 1 or -1 (fill); set "
                    f"a mesh size, e.g. {var}=2, or unset {var}."
                )
        source = "env " + ", ".join(mesh_vars.values())
        try:
            found["parallelism"] = (Parallelism(**sizes), source)
        except ValueError as err:  # two sizes of -1
            raise ValueError(f"{fn}: {source.removeprefix('env ')}: {err}") from None
    fsdp_vars = sorted(k for k in environ if k.startswith(ENV_FSDP_PREFIX))
    if fsdp_vars:
        found["fsdp"] = (_fsdp_from_env(fn, environ, fsdp_vars), "env " + ", ".join(fsdp_vars))
    if ENV_COMPILE in environ:
        text = environ[ENV_COMPILE]
        spelled = {"false": False, "true": True, "regional": "regional"}.get(text.lower(), text)
        mode = check_compile(fn, spelled, name=ENV_COMPILE)
        found["compile"] = (mode, f"env {ENV_COMPILE}")
    if ENV_ACTIVATION_CHECKPOINTING in environ:
        text = environ[ENV_ACTIVATION_CHECKPOINTING]
        if text.lower() not in ("true", "false"):
            raise ValueError(
                f"{fn}: {ENV_ACTIVATION_CHECKPOINTING}={text!r} must be true or false."
            )
        source = f"env {ENV_ACTIVATION_CHECKPOINTING}"
        found["activation_checkpointing"] = (text.lower() == "true", source)
    if ENV_DEEPSPEED in environ:
        found["deepspeed"] = (
            _deepspeed_from_env(fn, environ[ENV_DEEPSPEED]),
            f"env {ENV_DEEPSPEED}",
        )
    if ENV_LOG_WITH in environ:
        found["log_with"] = (
            parse_log_with(ENV_LOG_WITH, environ[ENV_LOG_WITH]),
            f"env {ENV_LOG_WITH}",
        )
    return found


def _deepspeed_from_env(fn: str, text: str) -> Section:
    import json  # on use: only a DeepSpeed launch carries this variable

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(
            f"{fn}: {ENV_DEEPSPEED}={text!r} must be a JSON object of Accelerate's "
            "deepspeed_config keys (accel launch writes it); unset it."
        )
    return tuple(sorted(value.items()))


def _fsdp_from_env(fn: str, environ: Mapping[str, str], names: list[str]) -> FSDPOptions:
    known = {f.name: f.type for f in fields(FSDPOptions)}
    values: dict[str, Any] = {}
    for var in names:
        name = var.removeprefix(ENV_FSDP_PREFIX).lower()
        text = environ[var]
        if name not in known:
            raise ValueError(
                f"{fn}: {var} names no FSDPOptions field; expected "
                f"{ENV_FSDP_PREFIX}<one of {sorted(known)}> (upper case)."
            )
        if name == "layer_classes":
            values[name] = tuple(n.strip() for n in text.split(",") if n.strip())
        elif name.endswith("_dtype"):
            values[name] = text
        elif text.lower() in ("true", "false"):
            values[name] = text.lower() == "true"
        else:
            raise ValueError(f"{fn}: {var}={text!r} must be true or false.")
    return FSDPOptions(**values)


def fsdp_environment(options: FSDPOptions) -> dict[str, str]:
    """The `ACCEL_FSDP_*` variables that carry `options` to `init_distributed` in a worker."""
    env: dict[str, str] = {}
    for f in fields(options):
        value = getattr(options, f.name)
        if f.name == "activation_checkpointing":  # deprecated here: ENV_ACTIVATION_CHECKPOINTING
            continue
        if f.name == "layer_classes":
            text = ",".join(c if isinstance(c, str) else c.__name__ for c in value)
        elif f.name.endswith("_dtype"):
            text = "" if value is None else str(value).removeprefix("torch.")
        else:
            text = str(value).lower()
        if text:
            env[ENV_FSDP_PREFIX + f.name.upper()] = text
    return env
