"""The variables Accelerate's own launcher exports, for the settings `accel launch` honours.

Code built on Accelerate (transformers' `Trainer`, any script that makes an `Accelerator()`)
reads its settings from `ACCELERATE_*`, `FSDP_*` and `PARALLELISM_CONFIG_*` variables that
`accelerate launch` sets (accelerate/utils/launch.py, `prepare_multi_gpu_env` and
`prepare_simple_launcher_cmd_env`, 1.15). `accel launch` sets the same ones from the same
config (each setting's variable is declared in the settings table), so such code sees what was
asked; what cannot reach it is named in a warning.
"""

from __future__ import annotations

from accel import config as _config
from accel._settings.table import accelerate_variables

# Settings that reach accel's own RunContext but not transformers' Trainer, which takes them
# from its TrainingArguments whatever the launcher says (its own `accelerate launch` included).
_TRAINER_ONLY_FROM_ARGS = (
    "gradient_accumulation_steps={steps} reaches accel (ctx.grad_accum_steps) and a plain "
    "Accelerator() (ACCELERATE_GRADIENT_ACCUMULATION_STEPS), but not transformers' Trainer, "
    "which takes it from TrainingArguments(gradient_accumulation_steps=...); pass it there too."
)


def accelerate_environment(
    config: _config.Config, *, trainer: bool = True, has_gpu: bool = True
) -> tuple[dict[str, str], list[str]]:
    """The `ACCELERATE_*` variables for `config`, and a warning for each setting that does not
    reach every library built on Accelerate (those that concern transformers' Trainer only when
    `trainer`: the script uses one). `has_gpu`: whether this machine has a CUDA device; without
    one several workers run on the CPU, and Accelerate is told so (one process stays as
    `use_cpu` says: Accelerate's `DistributedType.NO`, no process group)."""
    env = accelerate_variables(config)
    if not has_gpu and config.num_processes > 1 and "ACCELERATE_USE_CPU" in env:
        env["ACCELERATE_USE_CPU"] = "True"  # Accelerate's spelling (str(True)), as use_cpu's
    steps = config.gradient_accumulation_steps
    warnings = [_TRAINER_ONLY_FROM_ARGS.format(steps=steps)] if trainer and steps > 1 else []
    return env, warnings
