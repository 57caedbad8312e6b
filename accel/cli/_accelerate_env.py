"""The variables Accelerate's own launcher exports, for the settings `accel launch` honours.

Code built on Accelerate (transformers' `Trainer`, any script that makes an `Accelerator()`)
reads its settings from `ACCELERATE_*`, `FSDP_*` and `PARALLELISM_CONFIG_*` variables that
`accelerate launch` sets (accelerate/utils/launch.py, `prepare_multi_gpu_env` and
`prepare_simple_launcher_cmd_env`, 1.15). `accel launch` sets the same ones from the same
config, so such code sees what was asked; what cannot reach it is named in a warning.
"""

from __future__ import annotations

from accel import config as _config

# Settings that reach accel's own RunContext but not transformers' Trainer, which takes them
# from its TrainingArguments whatever the launcher says (its own `accelerate launch` included).
_TRAINER_ONLY_FROM_ARGS = (
    "gradient_accumulation_steps={steps} reaches accel (ctx.grad_accum_steps) and a plain "
    "Accelerator() (ACCELERATE_GRADIENT_ACCUMULATION_STEPS), but not transformers' Trainer, "
    "which takes it from TrainingArguments(gradient_accumulation_steps=...); pass it there too."
)


def accelerate_environment(
    config: _config.Config, *, trainer: bool = True
) -> tuple[dict[str, str], list[str]]:
    """The `ACCELERATE_*` variables for `config`, and a warning for each setting that does not
    reach every library built on Accelerate (those that concern transformers' Trainer only when
    `trainer`: the script uses one)."""
    precision = "no" if config.mixed_precision == "fp32" else config.mixed_precision
    env = {
        "ACCELERATE_MIXED_PRECISION": precision,
        "ACCELERATE_USE_CPU": str(config.use_cpu),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(config.gradient_accumulation_steps),
    }
    if config.mixed_precision == "fp8":
        env["ACCELERATE_FP8_BACKEND"] = "AO"  # the only fp8 backend accel trains with
    warnings = []
    if trainer and config.gradient_accumulation_steps > 1:
        warnings.append(_TRAINER_ONLY_FROM_ARGS.format(steps=config.gradient_accumulation_steps))
    dynamo = dict(config.dynamo_config)
    if str(dynamo.get("dynamo_backend", "NO")).upper() != "NO":
        for key, value in dynamo.items():
            env[f"ACCELERATE_{key.upper()}"] = (
                str(value).upper() if key == "dynamo_backend" else (str(value))
            )
    if config.distributed_type == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        env["FSDP_VERSION"] = "2"  # what accel shards with; other versions are refused
        for key, value in config.fsdp_config:
            name = "FSDP_TRANSFORMER_CLS_TO_WRAP" if key.endswith("_cls_to_wrap") else key.upper()
            text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
            env[name] = text.lower() if isinstance(value, bool) else text
    if config.distributed_type == "DEEPSPEED":  # the variables Accelerate's launcher writes
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        for key, value in config.deepspeed_config:
            if key == "gradient_accumulation_steps":  # ACCELERATE_GRADIENT_ACCUMULATION_STEPS
                continue
            name = key if key.startswith("deepspeed_") else f"deepspeed_{key}"
            name = {"deepspeed_zero3_init_flag": "deepspeed_zero3_init"}.get(name, name)
            name = "gradient_clipping" if key == "gradient_clipping" else name
            text = str(value)  # lower case as Accelerate writes them, paths and names as given
            keep = key.endswith(("_file", "_path", "_names", "_hostfile"))
            env[f"ACCELERATE_{name.upper()}"] = text if keep else text.lower()
    if config.parallelism_config:
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        for key, value in config.parallelism_config:
            env[key.upper()] = str(value)
    return env, warnings
