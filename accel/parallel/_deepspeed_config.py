"""The DeepSpeed config the engine is built with: read, translated, "auto" filled, checked.

Pure: no deepspeed import. A config is a DeepSpeed JSON (a dict or a path) or Accelerate's
`deepspeed_config` section (its values read by the settings table's rows, as the launcher reads
them) (`zero_stage`, `offload_optimizer_device`, ...); "auto" values are
filled from the context as Accelerate's `DeepSpeedPlugin` and `_prepare_deepspeed` fill them,
and a value that contradicts the context is an error naming both.

accel owns the accumulation window (`accumulate` tells the engine each boundary,
`scaled_backward` divides the loss), so the engine itself is built with
`gradient_accumulation_steps=1`; the user's value is checked against `ctx.grad_accum_steps`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from accel.context import RunContext
from accel_settings import SECTIONS, section_keys
from accel_settings.values import typed_section

ACCELERATE_KEYS = frozenset(section_keys("deepspeed_config"))
# What Accelerate's plugin maps each section key to in the DeepSpeed JSON.
_SECTION_TO_JSON = (
    ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("gradient_clipping", "gradient_clipping"),
    ("zero_stage", "zero_optimization.stage"),
    ("offload_optimizer_device", "zero_optimization.offload_optimizer.device"),
    ("offload_param_device", "zero_optimization.offload_param.device"),
    ("offload_optimizer_nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
    ("offload_param_nvme_path", "zero_optimization.offload_param.nvme_path"),
    ("zero3_save_16bit_model", "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
)
# Keys whose "auto" Accelerate fills from the model's hidden size (its _prepare_deepspeed).
_HIDDEN_SIZE_KEYS = (
    ("zero_optimization.reduce_bucket_size", lambda h: h * h),
    ("zero_optimization.stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    ("zero_optimization.stage3_param_persistence_threshold", lambda h: 10 * h),
)


def read_config(value: Any) -> tuple[dict[str, Any], bool]:
    """(the DeepSpeed JSON as a new dict, zero3_init_flag) from a dict, a path or a section."""
    if isinstance(value, (str, os.PathLike)):
        return _read_json(Path(value), "config"), False
    if not isinstance(value, Mapping):
        raise TypeError(
            f"wrap_model: DeepSpeedOptions.config={type(value).__name__} must be a DeepSpeed "
            "config dict, a path to its JSON file, or Accelerate's deepspeed_config section."
        )
    config = copy.deepcopy(dict(value))
    section = set(config) & ACCELERATE_KEYS - {"gradient_accumulation_steps", "gradient_clipping"}
    if not section:  # a DeepSpeed JSON as a dict
        return config, False
    return _from_section(config)


def _read_json(path: Path, key: str) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"wrap_model: DeepSpeed {key}={str(path)!r} does not exist; pass the path of a "
            "DeepSpeed JSON config (ds_config.json)."
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(f"wrap_model: DeepSpeed {key}={str(path)!r} is not JSON: {err}.") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"wrap_model: DeepSpeed {key}={str(path)!r} must hold a JSON object.")
    return loaded


def _from_section(section: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Accelerate's `deepspeed_config` section -> a DeepSpeed JSON, as its DeepSpeedPlugin does."""
    unknown = sorted(set(section) - ACCELERATE_KEYS)
    if unknown:
        raise ValueError(
            f"wrap_model: deepspeed_config keys {unknown} are not Accelerate's; expected some of "
            f"{sorted(ACCELERATE_KEYS)}. Fix the section, or pass a DeepSpeed JSON instead."
        )
    # Each value read by its row of the settings table, as `accel launch` read the launcher's
    # (a flag's "3" is 3; a bad value, or a key only Accelerate's launcher reads, is refused).
    section = typed_section(SECTIONS["deepspeed_config"], section, fn="wrap_model")
    init_flag = bool(section.get("zero3_init_flag", False))
    file = section.get("deepspeed_config_file")
    if file not in (None, "none", ""):
        config = _read_json(Path(file), "deepspeed_config_file")
        config.setdefault("gradient_accumulation_steps", 1)  # as Accelerate's plugin does
        if "zero_optimization" not in config:
            raise ValueError(
                f"wrap_model: deepspeed_config_file={file!r} has no zero_optimization section; "
                'add one, e.g. "zero_optimization": {"stage": 2}.'
            )
        for key, path in _SECTION_TO_JSON:  # the section's values fill the file's "auto"s
            if section.get(key) is not None:
                _fill(config, path, section[key], must_match=False)
        return config, init_flag
    stage = section.get("zero_stage", 2)
    zero: dict[str, Any] = {
        "stage": stage,
        "stage3_gather_16bit_weights_on_model_save": bool(
            section.get("zero3_save_16bit_model", False)
        ),
    }
    for kind in ("optimizer", "param"):
        device = section.get(f"offload_{kind}_device", "none") or "none"
        if device != "none":
            zero[f"offload_{kind}"] = {"device": device}
            if device == "nvme":
                zero[f"offload_{kind}"]["nvme_path"] = section.get(f"offload_{kind}_nvme_path")
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": section.get("gradient_accumulation_steps", "auto"),
        "gradient_clipping": section.get("gradient_clipping", "auto"),
        "zero_optimization": zero,
    }
    return config, init_flag


def _node(config: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding the last key of a dotted `path`, or None when a parent is missing."""
    *parents, key = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, key
    return (node if isinstance(node, dict) else None), key


def _fill(config: dict[str, Any], path: str, value: Any, *, must_match: bool) -> None:
    """Fill an "auto" at `path` with `value`; with must_match, a different value is an error."""
    node, key = _node(config, path)
    if node is None or key not in node:
        return
    if node[key] == "auto":
        node[key] = value
    elif must_match and node[key] != value:
        raise ValueError(
            f"wrap_model: the DeepSpeed config has {path}={node[key]!r} but the run has "
            f'{value!r}; make them agree (set {path} to "auto" to take the run\'s value).'
        )


def resolve_config(
    ctx: RunContext, model: nn.Module, raw: Any, *, micro_batch_size: int | None, client_opt: bool
) -> tuple[dict[str, Any], bool]:
    """(the engine's config, zero3_init_flag): "auto"s filled from `ctx`, conflicts refused."""
    config, init_flag = read_config(raw)
    config.setdefault("gradient_accumulation_steps", "auto")
    _fill(config, "gradient_accumulation_steps", ctx.grad_accum_steps, must_match=True)
    _precision(ctx, config)
    _fill(config, "gradient_clipping", 1.0, must_match=False)  # Accelerate's fill for "auto"
    micro = config.get("train_micro_batch_size_per_gpu")
    if micro == "auto" or micro is None:
        if micro_batch_size is None:
            raise ValueError(
                "wrap_model: the DeepSpeed config has train_micro_batch_size_per_gpu="
                f"{micro!r} and DeepSpeedOptions(micro_batch_size=None); pass the per-rank "
                "batch size of one forward: DeepSpeedOptions(..., micro_batch_size=8)."
            )
        micro = config["train_micro_batch_size_per_gpu"] = micro_batch_size
    elif micro_batch_size is not None and micro != micro_batch_size:
        raise ValueError(
            f"wrap_model: the DeepSpeed config has train_micro_batch_size_per_gpu={micro!r} but "
            f"DeepSpeedOptions(micro_batch_size={micro_batch_size!r}); make them agree."
        )
    config.setdefault("train_batch_size", "auto")
    _fill(
        config, "train_batch_size", micro * ctx.grad_accum_steps * ctx.world_size, must_match=True
    )
    hidden = _hidden_size(model)
    for path, rule in _HIDDEN_SIZE_KEYS:
        node, key = _node(config, path)
        if node is not None and node.get(key) == "auto":
            if hidden is None:
                raise ValueError(
                    f"wrap_model: the DeepSpeed config has {path}='auto', which is filled from "
                    f"model.config.hidden_size, and {type(model).__name__} has none; set a number."
                )
            node[key] = rule(hidden)
    left = _autos(config)
    if left:
        raise ValueError(
            f"wrap_model: the DeepSpeed config keeps 'auto' at {left}, which accel does not "
            "fill (it fills precision, accumulation, batch sizes, clipping and the hidden-size "
            "bucket sizes); set explicit values."
        )
    if client_opt:  # as Accelerate does for a torch optimizer passed in code
        config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", float("inf"))  # Accelerate silences the step log too
    return config, init_flag


def _precision(ctx: RunContext, config: dict[str, Any]) -> None:
    """bf16/fp16 sections from ctx.precision, as Accelerate's set_mixed_precision writes them."""
    if ctx.precision not in ("fp32", "bf16"):
        raise NotImplementedError(
            f"wrap_model: precision={ctx.precision!r} with strategy='deepspeed' is not "
            "supported by accel (fp16 needs the engine's loss scaler, fp8 torchao's "
            "float8 layers); use precision='bf16' or 'fp32'."
        )
    for dtype in ("bf16", "fp16"):
        section = config.get(dtype)
        if section is None:
            config[dtype] = {"enabled": ctx.precision == dtype}
            continue
        want = ctx.precision == dtype
        enabled = section.get("enabled", False)
        if enabled == "auto":
            section["enabled"] = want
        elif bool(enabled) != want:
            raise ValueError(
                f"wrap_model: the DeepSpeed config has {dtype}.enabled={enabled!r} but "
                f"ctx.precision={ctx.precision!r}; make them agree (set {dtype}.enabled to "
                '"auto", or launch with --mixed_precision matching the config).'
            )


def _hidden_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if hidden is None and getattr(cfg, "hidden_sizes", None):
        hidden = max(cfg.hidden_sizes)  # type: ignore[union-attr]
    return hidden if isinstance(hidden, int) else None


def _autos(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in _autos(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if config == "auto" else []


def engine_config(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The config handed to the engine: accel owns accumulation, so the engine's window is 1."""
    out = copy.deepcopy(config)
    out["gradient_accumulation_steps"] = 1
    out["train_batch_size"] = out["train_micro_batch_size_per_gpu"] * world_size
    return out
