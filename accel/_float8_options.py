"""fp8 training's settings: which Linear layers become float8, and Accelerate's `fp8_config`.

Pure values and checks, with no torchao import: `Float8Options` is what
`wrap_model(..., fp8=...)` takes (accel.parallel._float8 applies it through torchao), and
`check_fp8_config` honours or refuses each key of Accelerate's `fp8_config` section (its YAML and
its `--fp8_*` launch flags) by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import nn

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
"""torchao's float8 recipes (`Float8LinearConfig.from_recipe_name`): one scale per tensor, or
per row (rowwise_with_gw_hp keeps the weight gradient's matmul in high precision)."""

ModuleFilter = Callable[[nn.Module, str], bool]
"""fn(linear, fully_qualified_name) -> True to convert that nn.Linear to float8."""

HEAD_NAMES = ("lm_head", "output")
"""Names of an output head (Hugging Face's, torchtitan's): kept in high precision by default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Float8Options:
    """How `wrap_model` trains Linear layers in float8 when `ctx.precision == "fp8"`.

    The default converts every `nn.Linear` whose in and out features are multiples of 16 (what
    float8 matmuls need) except the output head: the Linear named `lm_head` or `output`, or,
    when none is, the last Linear registered. That is torchtitan's default and Accelerate's
    (which keeps the first Linear in high precision too; pass a filter to do the same).

    Example:
        >>> from accel import Float8Options
        >>> Float8Options(module_filter_fn=lambda m, name: not name.startswith("head")).recipe
        'tensorwise'
    """

    module_filter_fn: ModuleFilter | None = None
    """Which nn.Linear layers to convert: called as fn(module, name) for each (torchao's
    `module_filter_fn`, Accelerate's `module_filter_func`); True converts it. None: the default
    above. Layers whose dimensions are not multiples of 16 need pad_inner_dim."""
    recipe: Recipe = "tensorwise"
    """torchao's scaling recipe: "tensorwise", "rowwise" or "rowwise_with_gw_hp"."""
    enable_fsdp_float8_all_gather: bool | None = None
    """Under FSDP2, all-gather converted weights in float8 (half the bytes of bf16) with one
    all-reduce of their scales per forward. None: on with the tensorwise recipe, the only one
    torchao supports it with."""
    pad_inner_dim: bool = True
    """Pad matmul dimensions to multiples of 16 for layers the filter converts that need it
    (Accelerate's default; torchao's is False)."""

    def __post_init__(self) -> None:
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise TypeError(
                f"Float8Options: module_filter_fn={self.module_filter_fn!r} is not callable; "
                "pass a function (module, name) -> bool, e.g. "
                "module_filter_fn=lambda m, name: name != 'lm_head', or None for the default."
            )
        if self.recipe not in get_args(Recipe):
            raise ValueError(
                f"Float8Options: recipe={self.recipe!r} is not one of {get_args(Recipe)} "
                "(torchao's recipe names). Use recipe='tensorwise'."
            )
        for name in ("enable_fsdp_float8_all_gather", "pad_inner_dim"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name.startswith("enable")):
                raise TypeError(f"Float8Options: {name}={value!r} must be True or False.")
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"Float8Options: enable_fsdp_float8_all_gather=True needs recipe='tensorwise' "
                f"(torchao gathers float8 weights with one scale per tensor), not "
                f"recipe={self.recipe!r}. Drop enable_fsdp_float8_all_gather, or use "
                "recipe='tensorwise'."
            )


def default_filter(model: nn.Module) -> ModuleFilter:
    """The default `module_filter_fn` for `model`: dims multiples of 16, not the output head."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = {n for n in linears if n.rsplit(".", 1)[-1] in HEAD_NAMES} or set(linears[-1:])

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name in heads:
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


# Accelerate's fp8_config keys (YAML spells them bare, `accelerate launch` with the fp8_ prefix).
FP8_KEYS = (
    "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision",
    "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim",
)  # fmt: skip
_TE_KEYS = frozenset(FP8_KEYS[1:8])
# Keys whose only value accel applies from a config (the default of Float8Options); another
# value is set in code, where the options reach wrap_model.
_DEFAULT_ONLY = {"fp8_enable_fsdp_float8_all_gather": True, "fp8_pad_inner_dim": True}


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
    else:
        text = str(value).lower()
        if text not in ("true", "false"):
            raise ValueError(f"config: fp8_config {name}={value!r} must be true or false.")
        if (text == "true") != _DEFAULT_ONLY[name]:
            field = name.removeprefix("fp8_")
            raise NotImplementedError(
                f"config: fp8_config {field}={value!r} cannot reach wrap_model from a config; "
                f"pass it in code: wrap_model(ctx, model, fp8=Float8Options({field}=False))."
            )
