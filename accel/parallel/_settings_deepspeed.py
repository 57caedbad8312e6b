"""The DeepSpeed section of the settings table: Accelerate's `deepspeed_config` keys (its YAML
section, its DeepSpeedPlugin fields), RunContext's `deepspeed`, `ACCEL_DEEPSPEED_CONFIG`.

Declarations import only the standard library and `accel_cli._setting`; see _settings_fsdp.
`wrap_model` (accel.parallel._deepspeed_config) honours each key or refuses it by name.
"""

from __future__ import annotations

from typing import Any

from accel_cli._setting import Section, Setting


def _key(key: str, kind: str, help: str, accelerate: str | None = None) -> Setting:
    name = key if key.startswith("deepspeed_") else f"deepspeed_{key}"
    keep = key.endswith(("_file", "_path", "_names", "_hostfile"))  # as given, not lower case
    return Setting(key=key, kind=kind, help=help,
                   accelerate_env=accelerate or f"ACCELERATE_{name.upper()}",
                   accelerate_case="" if keep else "lower")  # fmt: skip


def _build(config: Any) -> dict[str, Any]:
    """As in Accelerate, the section's gradient_accumulation_steps is the run's when the
    top-level key is left at 1; two different values are refused."""
    from accel._settings.values import (  # on use: the command line reads this file without accel
        known,
        parse,
    )

    values = known(config, SECTION, ("DEEPSPEED", "--use_deepspeed"))
    if config.distributed_type != "DEEPSPEED":
        return {}
    found: dict[str, Any] = {"deepspeed": tuple(sorted(values.items()))}
    steps = config.gradient_accumulation_steps
    inner = values.get("gradient_accumulation_steps", "auto")
    if inner != "auto":
        inner = parse("count", "deepspeed_config.gradient_accumulation_steps", inner)
        if steps not in (1, inner):
            raise ValueError(
                f"config: gradient_accumulation_steps={steps} but deepspeed_config has "
                f"gradient_accumulation_steps={inner}; set one of them (or make them equal)."
            )
        found["grad_accum_steps"] = inner
    return found


SECTION = Section(
    name="deepspeed_config",
    title="DeepSpeed Arguments",
    description="Arguments related to DeepSpeed (wrap_model's DeepSpeed engine).",
    shown_with="use_deepspeed",
    order=50,
    accelerate_switch=(("ACCELERATE_USE_DEEPSPEED", "true"),),
    active=lambda config: config.distributed_type == "DEEPSPEED",
    build=_build,
    settings=(
        _key("zero_stage", "index", "ZeRO stage: 0, 1, 2 or 3"),
        _key("offload_optimizer_device", "any", "none, cpu or nvme"),
        _key("offload_param_device", "any", "none, cpu or nvme"),
        _key("gradient_clipping", "float", "max gradient norm (auto: the engine's)",
             "ACCELERATE_GRADIENT_CLIPPING"),
        _key("zero3_init_flag", "bool", "build the model ZeRO-3 sharded (true/false)",
             "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
        _key("zero3_save_16bit_model", "bool", "gather 16-bit weights on save (true/false)"),
        _key("deepspeed_config_file", "any", "a DeepSpeed JSON whose autos the section fills"),
        Setting(key="gradient_accumulation_steps", kind="count", flag=False,
                help="the run's accumulation steps when the top-level key is 1"),
        _key("offload_optimizer_nvme_path", "any", "where nvme offload writes the optimizer"),
        _key("offload_param_nvme_path", "any", "where nvme offload writes the parameters"),
        _key("deepspeed_multinode_launcher", "any", "refused unless standard (torchrun)"),
        _key("deepspeed_hostfile", "any", "refused: accel launches through torchrun"),
        _key("deepspeed_exclusion_filter", "any", "refused: accel launches through torchrun"),
        _key("deepspeed_inclusion_filter", "any", "refused: accel launches through torchrun"),
        _key("deepspeed_moe_layer_cls_names", "any", "refused: ZeRO-3 MoE leaf modules"),
        Setting(key=None, kind="json_section", field="deepspeed", env="ACCEL_DEEPSPEED_CONFIG",
                help="Accelerate's deepspeed_config section, as JSON"),
    ),
)  # fmt: skip
