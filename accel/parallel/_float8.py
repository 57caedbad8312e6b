"""fp8 training for `wrap_model`: torchao's float8 Linear layers, converted before TP and FSDP2.

`Float8Options` (the `fp8=` of `wrap_model`) chooses the layers; nothing here imports torchao
until a model is wrapped under fp8. When `ctx.precision == "fp8"`, the Linear layers the filter
keeps become torchao `Float8Linear`s (their matmuls run in float8 with dynamic scales,
`torch._scaled_mm`), before tensor parallelism and FSDP2, as torchtitan orders it;
autocast(ctx) is bf16 for the rest of the model. Under tensor parallelism their "colwise" /
"rowwise" styles become torchao's Float8ColwiseParallel / Float8RowwiseParallel. Under FSDP2
with the tensorwise recipe, their weights are all-gathered in float8, and the scales of all of
them are computed with one all-reduce (`precompute_float8_dynamic_scale_for_fsdp`).

Where that precompute runs: a forward pre-hook on the wrapped model, ahead of FSDP2's own, runs
it before every forward. torchao keeps a precomputed scale until the next precompute, so a
scale computed once per optimizer step goes stale whenever weights change some other way (a
plain `optimizer.step()` the user calls by hand, `load_state`), and a stale scale saturates or
underflows silently. Before each forward it is always the scale of the weights about to be
gathered; the cost is one small all-reduce per forward (a few per step under gradient
accumulation), next to the all-gathers FSDP2 does per forward anyway. The hook lives on the
model, so there is no state outside it and nothing for the user's loop to call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import nn

from accel.context import RunContext
from accel.parallel._plan import WrapPlan

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
    float8 matmuls need) and large enough to gain from float8 by torchao's size thresholds for
    the recipe (`skip_small`), except the output head: the Linear named `lm_head` or `output`,
    or, when none is, the last Linear registered. That is torchtitan's default with its
    `auto_filter_small_kn`; Accelerate's keeps the first Linear in high precision too (pass a
    filter to do the same).

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
    skip_small: bool = True
    """The default filter leaves in bf16 the Linear layers too small to gain from float8 (where
    float8's casts cost more than its matmul saves): torchao's thresholds for the recipe,
    `small_for_float8`. False converts them too (every Linear with dims multiples of 16 but the
    head). A `module_filter_fn` decides alone."""

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
        for name in ("enable_fsdp_float8_all_gather", "pad_inner_dim", "skip_small"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name.startswith("enable")):
                raise TypeError(f"Float8Options: {name}={value!r} must be True or False.")
        if self.module_filter_fn is not None and not self.skip_small:
            raise ValueError(
                "Float8Options: skip_small=False shapes the default filter, and "
                "module_filter_fn is given, which decides alone which layers convert. Drop "
                "skip_small, or leave small layers out in module_filter_fn."
            )
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"Float8Options: enable_fsdp_float8_all_gather=True needs recipe='tensorwise' "
                f"(torchao gathers float8 weights with one scale per tensor), not "
                f"recipe={self.recipe!r}. Drop enable_fsdp_float8_all_gather, or use "
                "recipe='tensorwise'."
            )


def small_for_float8(recipe: Recipe, in_features: int, out_features: int) -> bool:
    """True when a Linear of these sizes is too small to gain from float8 under `recipe`.

    torchao's own thresholds, from its H100 microbenchmarks of a whole float8 Linear (casts
    and scales included) against bf16: `_auto_filter_for_tensorwise` and
    `_auto_filter_for_rowwise` in torchao/float8/float8_linear_utils.py (torchao 0.18; the
    tables in torchao/float8/README.md, "Performance"). With K the in and N the out features:
    tensorwise loses when K <= 4096 and N <= 1024; rowwise when N <= 2048, K <= 1024, or
    N <= 4096 and K <= 2048. torchao has none for rowwise_with_gw_hp, whose forward and input
    gradient matmuls are rowwise and whose weight gradient stays in bf16: it gains less than
    rowwise, so rowwise's thresholds are the least it needs.
    """
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def default_filter(model: nn.Module, options: Float8Options) -> ModuleFilter:
    """The default `module_filter_fn` for `model`: dims multiples of 16, large enough to gain
    (unless `options.skip_small` is False), not the output head."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = {n for n in linears if n.rsplit(".", 1)[-1] in HEAD_NAMES} or set(linears[-1:])

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name in heads:
            return False
        k, n = module.in_features, module.out_features
        if k % 16 or n % 16:
            return False
        return not (options.skip_small and small_for_float8(options.recipe, k, n))

    return keep


@dataclass(frozen=True, slots=True, kw_only=True)
class Float8Plan:
    """What fp8 training does to the model, decided before it changes."""

    config: Any
    """torchao's Float8LinearConfig for every converted layer."""
    converted: frozenset[str]
    """Names of the nn.Linear modules that become Float8Linear."""
    precompute: bool
    """FSDP2 gathers float8 weights: compute their scales before each forward."""


def import_float8() -> Any:
    """torchao.float8, or an ImportError naming the extra."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError(
            "wrap_model: ctx.precision='fp8' trains Linear layers through torchao's float8 "
            f"training, and torchao cannot be imported ({err}); install it with "
            "`pip install torchao` (or `pip install -e '.[fp8]'` in accel's checkout)."
        ) from err
    return float8


def plan_float8(
    ctx: RunContext, model: nn.Module, options: Float8Options | None, plan: WrapPlan
) -> tuple[Float8Plan | None, WrapPlan]:
    """Validate fp8 against the wrap plan; choose the layers, the config and the TP styles."""
    if ctx.precision != "fp8":
        if options is not None:
            raise ValueError(
                f"wrap_model: fp8={options!r} was given but ctx.precision={ctx.precision!r}; "
                "build the context with precision='fp8' "
                "(accel.init_distributed(precision='fp8')), or drop fp8=."
            )
        return None, plan
    if options is None:
        options = Float8Options()
    if not isinstance(options, Float8Options):
        raise TypeError(
            f"wrap_model: fp8={options!r} is not an accel.Float8Options; pass "
            "fp8=Float8Options(module_filter_fn=...), or None for the default."
        )
    float8 = import_float8()
    converted = _choose_layers(model, options)
    gather = options.enable_fsdp_float8_all_gather
    if gather and plan.data != "fsdp2":
        raise ValueError(
            f"wrap_model: Float8Options(enable_fsdp_float8_all_gather=True) applies to FSDP2, "
            f"and this model is wrapped with {plan.data!r}; drop it (None turns it on "
            "whenever FSDP2 shards), or shard with Parallelism(dp_shard=...)."
        )
    if gather is None:
        gather = plan.data == "fsdp2" and options.recipe == "tensorwise"
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(options.recipe),
        enable_fsdp_float8_all_gather=gather,
        pad_inner_dim=options.pad_inner_dim,
    )
    if gather and ctx.backend == "gloo":
        _check_gloo_units(model, plan, converted)
    styles = None if plan.tp_styles is None else _float8_styles(plan.tp_styles, converted)
    fp8_plan = Float8Plan(config=config, converted=converted, precompute=gather)
    return fp8_plan, dataclasses.replace(plan, tp_styles=styles)


def _choose_layers(model: nn.Module, options: Float8Options) -> frozenset[str]:
    keep = options.module_filter_fn or default_filter(model, options)
    converted = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        decision = keep(module, name)
        if not isinstance(decision, bool):
            raise TypeError(
                f"wrap_model: Float8Options.module_filter_fn returned {decision!r} for "
                f"{name!r}; it must return True (convert to float8) or False."
            )
        if decision:
            converted.add(name)
    if not converted:
        linears = [
            f"{n} ({m.in_features}->{m.out_features})"
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
        ][:8]
        raise ValueError(
            f"wrap_model: ctx.precision='fp8' but no nn.Linear of {type(model).__name__} passes "
            f"the float8 filter (its Linear layers: {linears}; the default converts those whose "
            "in and out features are multiples of 16 and large enough to gain from float8 by "
            f"torchao's thresholds for recipe={options.recipe!r}, except the output head). "
            "Train in precision='bf16' (float8 would be slower), or convert them anyway with "
            "fp8=Float8Options(skip_small=False) or Float8Options(module_filter_fn=...)."
        )
    return frozenset(converted)


def _float8_styles(styles: Any, converted: frozenset[str]) -> dict[str, Any]:
    """The TP plan with torchao's float8 styles on converted layers (same layouts)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    out = dict(styles)
    for name, style in styles.items():
        if name not in converted or isinstance(
            style, (Float8ColwiseParallel, Float8RowwiseParallel)
        ):
            continue
        kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
        new = kind.get(type(style))
        if new is None:
            raise NotImplementedError(
                f"wrap_model: tp_plan gives {name!r} the style {type(style).__name__}, and fp8 "
                "converts that layer to float8, which splits with torchao's "
                "Float8ColwiseParallel or Float8RowwiseParallel only. Use 'colwise' or "
                "'rowwise', or leave the layer out of the float8 filter."
            )
        out[name] = new(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    return out


def _check_gloo_units(model: nn.Module, plan: WrapPlan, converted: frozenset[str]) -> None:
    """Refuse an FSDP2 unit holding only float8-gathered weights on gloo (no float8 dtype).

    FSDP2 all-gathers a unit's parameters in their dtype when they share one, else as bytes;
    gloo refuses float8 tensors ("Invalid scalar type"), so a unit of float8 weights alone
    fails on it, while one with any other parameter (a norm, a bias) goes through as bytes.
    """
    float8 = {id(model.get_submodule(n).weight) for n in converted}
    units = [*plan.fsdp_layers, model]
    claimed: set[int] = set()
    for unit in units:
        owned = {id(p) for p in unit.parameters()} - claimed
        claimed |= owned
        if owned and owned <= float8:
            raise NotImplementedError(
                f"wrap_model: on the gloo backend, FSDP2 cannot all-gather the unit "
                f"{type(unit).__name__} in float8: all its parameters are float8 weights and "
                "gloo has no float8 dtype (NCCL has). Pass "
                "fp8=Float8Options(enable_fsdp_float8_all_gather=False), or give the unit a "
                "parameter kept in high precision."
            )


def convert(model: nn.Module, fp8_plan: Float8Plan) -> None:
    """Swap the planned nn.Linear modules for torchao's Float8Linear, in place."""
    from torchao.float8 import convert_to_float8_training

    names = fp8_plan.converted
    convert_to_float8_training(
        model, config=fp8_plan.config, module_filter_fn=lambda _m, name: name in names
    )


def precompute_before_forward(model: nn.Module) -> None:
    """Compute the float8 weights' scales with one all-reduce before each forward of `model`.

    Prepended, so it runs before FSDP2's pre-forward all-gathers (see the module docstring).
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(module: nn.Module, _args: Any) -> None:
        precompute_float8_dynamic_scale_for_fsdp(module)

    model.register_forward_pre_hook(hook, prepend=True)
