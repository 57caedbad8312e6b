"""The DeepSpeed section of the settings table: Accelerate's `deepspeed_config` keys (its YAML
section, its DeepSpeedPlugin fields), `deepspeed` of RunContext's `wrap`, `ACCEL_DEEPSPEED_CONFIG`.

Every key is read by its row's parser in the launcher (a bad value is refused before any worker
starts); the workers read the same section back through the same rows, and
`accel.parallel._deepspeed_config` translates it into the DeepSpeed JSON as Accelerate does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accel_settings._rows import Section, Setting

_TORCHRUN = "accel launches each machine through torchrun, not Accelerate's `deepspeed` launcher"


def _key(key: str, kind: str, help: str, accelerate: str | None = None, **more: Any) -> Setting:
    name = key if key.startswith("deepspeed_") else f"deepspeed_{key}"
    keep = key.endswith(("_file", "_path", "_names", "_hostfile"))  # as given, not lower case
    return Setting(key=key, kind=kind, help=help,
                   accelerate_env=accelerate or f"ACCELERATE_{name.upper()}",
                   accelerate_case="" if keep else "lower", **more)  # fmt: skip


def _launcher(key: str, help: str, *allowed: Any) -> Setting:
    """A key only Accelerate's multi-node launcher reads: refused unless at its default."""
    return _key(key, "any", help, allowed=((*allowed, None, "none", ""), _TORCHRUN))


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """The run's section, and, as in Accelerate, its gradient_accumulation_steps as the run's
    when the top-level key is left at 1 (two different values are refused)."""
    if config.distributed_type != "DEEPSPEED":
        return dict(found)
    out: dict[str, Any] = {**found, "deepspeed": tuple(sorted(values.items()))}
    steps = config.gradient_accumulation_steps
    inner = values.get("gradient_accumulation_steps", "auto")
    if inner != "auto":
        if steps not in (1, inner):
            raise ValueError(
                f"config: gradient_accumulation_steps={steps} but deepspeed_config has "
                f"gradient_accumulation_steps={inner}; set one of them (or make them equal)."
            )
        out["grad_accum_steps"] = inner
    return out


SECTION = Section(
    name="deepspeed_config",
    title="DeepSpeed Arguments",
    description="Arguments related to DeepSpeed (wrap_model's DeepSpeed engine).",
    shown_with="use_deepspeed",
    order=50,
    strategy=("DEEPSPEED", "--use_deepspeed"),
    accelerate_switch=(("ACCELERATE_USE_DEEPSPEED", "true"),),
    active=lambda config: config.distributed_type == "DEEPSPEED",
    rules=_rules,
    settings=(
        _key("zero_stage", "zero_stage", "ZeRO stage: 0, 1, 2 or 3"),
        _key("offload_optimizer_device", "offload_device", "none, cpu or nvme"),
        _key("offload_param_device", "offload_device", "none, cpu or nvme"),
        _key("gradient_clipping", "auto_float", "max gradient norm (auto: the engine's)",
             "ACCELERATE_GRADIENT_CLIPPING"),
        _key("zero3_init_flag", "bool", "build the model ZeRO-3 sharded (true/false)",
             "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
        _key("zero3_save_16bit_model", "bool", "gather 16-bit weights on save (true/false)"),
        _key("deepspeed_config_file", "text", "a DeepSpeed JSON whose autos the section fills"),
        Setting(key="gradient_accumulation_steps", kind="auto_count", flag=False,
                help="the run's accumulation steps when the top-level key is 1"),
        _key("offload_optimizer_nvme_path", "text", "where nvme offload writes the optimizer"),
        _key("offload_param_nvme_path", "text", "where nvme offload writes the parameters"),
        _launcher("deepspeed_multinode_launcher", "refused unless standard (torchrun)",
                  "standard"),
        _launcher("deepspeed_hostfile", "refused: accel launches through torchrun"),
        _launcher("deepspeed_exclusion_filter", "refused: accel launches through torchrun"),
        _launcher("deepspeed_inclusion_filter", "refused: accel launches through torchrun"),
        _key("deepspeed_moe_layer_cls_names", "any", "refused: ZeRO-3 MoE leaf modules",
             allowed=((None, "none", ""), "ZeRO-3 MoE leaf modules are not supported by accel")),
        Setting(key=None, kind="json_section", field="deepspeed", env="ACCEL_DEEPSPEED_CONFIG",
                help="Accelerate's deepspeed_config section, as JSON"),
    ),
)  # fmt: skip
