"""The fp8 section of the settings table: Accelerate's `fp8_config` keys, each honoured (checked
against what `wrap_model` does under precision "fp8") or refused by name.

YAML spells the keys bare (`backend: AO`), `accelerate launch` with the fp8_ prefix. Nothing
reaches the workers from here: precision "fp8" does, and the rest is refused or at the value
wrap_model applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from accel_settings._rows import Section, Setting
from accel_settings.values import parse

FP8_KEYS = (
    "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision",
    "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim",
)  # fmt: skip
_TE_KEYS = frozenset(FP8_KEYS[1:8])
# Keys whose only value accel applies from a config (the default of Float8Options); another
# value is set in code, where the options reach wrap_model.
_DEFAULT_ONLY = MappingProxyType(
    {"fp8_enable_fsdp_float8_all_gather": True, "fp8_pad_inner_dim": True}
)
_HELP = MappingProxyType(
    {
        "fp8_backend": "AO (torchao's float8); TE and MSAMP are refused",
        "fp8_opt_level": "refused: an MS-AMP setting",
        "fp8_enable_fsdp_float8_all_gather": "true (set False in code: Float8Options)",
        "fp8_pad_inner_dim": "true (set False in code: Float8Options)",
    }
)


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    check_fp8_config(config.mixed_precision, config.fp8_config)
    return dict(found)


def check_fp8_config(precision: str, pairs: tuple[tuple[str, Any], ...]) -> None:
    """Honour or refuse, by name, each key of Accelerate's `fp8_config` section.

    Raises:
        ValueError: for an unknown key, a bad value, or fp8 settings without precision fp8.
        NotImplementedError: for Transformer Engine's or MS-AMP's backend and settings, and
            for torchao settings a config cannot carry (set them in Float8Options instead).
    """
    for key, value in pairs:
        name = key if key.startswith("fp8_") else f"fp8_{key}"
        if name not in FP8_KEYS:
            raise ValueError(
                f"config: fp8_config has unknown key {key!r}; accel knows "
                f"{sorted(k.removeprefix('fp8_') for k in FP8_KEYS)}. Remove or rename it."
            )
        if precision != "fp8":
            raise ValueError(
                f"config: fp8_config {key}={value!r} is given but mixed_precision="
                f"{precision!r}; set mixed_precision: fp8, or remove fp8_config."
            )
        _check_fp8_key(name, value)


def _check_fp8_key(name: str, value: Any) -> None:
    if name == "fp8_backend":
        if str(value).upper() in ("TE", "MSAMP"):
            engine = "Transformer Engine" if str(value).upper() == "TE" else "MS-AMP"
            raise NotImplementedError(
                f"config: fp8_config backend={value!r} ({engine}) is not supported: accel "
                "trains fp8 through torchao's float8. Set backend: AO."
            )
        if str(value).upper() != "AO":
            raise ValueError(f"config: fp8_config backend={value!r} must be AO, TE or MSAMP.")
    elif name in _TE_KEYS:
        raise NotImplementedError(
            f"config: fp8_config {name.removeprefix('fp8_')}={value!r} is a Transformer Engine "
            "setting, and accel trains fp8 through torchao (dynamic scaling, no amax history). "
            "Remove it."
        )
    elif name == "fp8_opt_level":
        raise NotImplementedError(
            f"config: fp8_config opt_level={value!r} is an MS-AMP setting, and accel trains fp8 "
            "through torchao. Remove it."
        )
    elif parse("bool", f"fp8_config {name}", value) != _DEFAULT_ONLY[name]:
        field = name.removeprefix("fp8_")
        raise NotImplementedError(
            f"config: fp8_config {field}={value!r} cannot reach wrap_model from a config; "
            f"pass it in code: wrap_model(ctx, model, fp8=Float8Options({field}=False))."
        )


SECTION = Section(
    name="fp8_config",
    title="FP8 Arguments",
    description="Arguments related to FP8 training (requires `--mixed_precision=fp8`).",
    order=70,
    accelerate_switch=(("ACCELERATE_FP8_BACKEND", "AO"),),  # the only backend accel trains with
    active=lambda config: config.mixed_precision == "fp8",
    key_prefix="fp8_",
    rules=_rules,
    settings=tuple(
        Setting(key=key, kind="any",
                help=_HELP.get(key, "refused: a Transformer Engine setting"))
        for key in FP8_KEYS
    ),
)  # fmt: skip
