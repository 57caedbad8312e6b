"""The DeepSpeed config wrap_model builds an engine from: translation, "auto" filling, refusals.

Pure: no engine is built (tests/dist/test_deepspeed_dist.py builds real ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from accel.parallel._deepspeed_config import engine_config, read_config, resolve_config


def _resolve(
    raw: Any, *, model: nn.Module | None = None, micro: int | None = 4, **ctx: Any
) -> dict[str, Any]:
    c = RunContext.single(**ctx)
    return resolve_config(
        c, model or nn.Linear(2, 2), raw, micro_batch_size=micro, client_opt=True
    )[0]


def test_accelerate_section_becomes_the_json_accelerate_writes() -> None:
    section = {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "none",
        "gradient_clipping": 0.5, "zero3_save_16bit_model": True, "zero3_init_flag": False,
        "gradient_accumulation_steps": 2,
    }  # fmt: skip
    config = _resolve(section, grad_accum_steps=2, precision="bf16")
    assert config["zero_optimization"] == {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu"},
    }
    assert config["gradient_clipping"] == 0.5
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["train_batch_size"] == 8  # micro x accumulation x world
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_allow_untested_optimizer"] is True


def test_autos_are_filled_from_the_context_as_accelerate_fills_them() -> None:
    raw = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
    }  # fmt: skip
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(hidden_size=16)  # type: ignore[assignment]  (an HF config)
    config = _resolve(raw, model=model, grad_accum_steps=3)
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12
    assert config["gradient_clipping"] == 1.0  # Accelerate's value for "auto"
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 256
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 256)
    assert zero["stage3_param_persistence_threshold"] == 160
    engine = engine_config(config, world_size=2)  # accel owns the window: the engine's is 1
    assert engine["gradient_accumulation_steps"] == 1 and engine["train_batch_size"] == 8
    assert config["gradient_accumulation_steps"] == 3  # the input is not changed


def test_a_path_to_a_json_and_accelerates_config_file_key(tmp_path: Path) -> None:
    file = tmp_path / "ds.json"
    file.write_text(
        json.dumps({"zero_optimization": {"stage": "auto"}, "gradient_clipping": "auto"})
    )
    with pytest.raises(ValueError, match=r"keeps 'auto' at \['zero_optimization.stage'\]"):
        _resolve(file)  # a DeepSpeed JSON alone: nothing fills the stage
    section = {"deepspeed_config_file": str(file), "zero_stage": 2, "gradient_clipping": 0.3}
    config = _resolve(section)
    assert config["zero_optimization"]["stage"] == 2  # the section fills the file's "auto"s
    assert config["gradient_clipping"] == 0.3


@pytest.mark.parametrize(
    ("raw", "ctx", "match"),
    [
        ({"gradient_accumulation_steps": 4}, {"grad_accum_steps": 2},
         r"gradient_accumulation_steps=4 but the run has 2"),
        ({"bf16": {"enabled": True}}, {}, r"bf16.enabled=True but ctx.precision='fp32'"),
        ({"train_batch_size": 64}, {}, r"train_batch_size=64 but the run has 4"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, {},
         r"reduce_bucket_size='auto'.*hidden_size"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {},
         r"'auto' at \['optimizer.params.lr'\]"),
        ({"zero_stage": 2, "deepspeed_multinode_launcher": "pdsh"}, {},
         r"deepspeed_multinode_launcher='pdsh'"),
        ({"zero_stage": 2, "zero_sage": 3}, {}, r"\['zero_sage'\] are not Accelerate's"),
    ],
)  # fmt: skip
def test_conflicts_and_unfillable_values_are_refused_by_name(
    raw: dict[str, Any], ctx: dict[str, Any], match: str
) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=match):
        _resolve(raw, **ctx)


def test_fp16_and_a_missing_micro_batch_size_are_refused() -> None:
    with pytest.raises(NotImplementedError, match=r"precision='fp16' with strategy='deepspeed'"):
        _resolve({"zero_stage": 2}, precision="fp16")
    with pytest.raises(ValueError, match=r"micro_batch_size=None"):
        _resolve({"zero_stage": 2}, micro=None)
    assert read_config({"zero_stage": 3, "zero3_init_flag": True})[1] is True


@pytest.mark.slow  # about 2 s: the first wrap_model call imports FSDP
def test_wrap_model_refuses_half_a_deepspeed_request() -> None:
    ctx = RunContext.single()
    model = nn.Linear(2, 2)
    opts = accel.DeepSpeedOptions(
        config={"zero_stage": 2}, optimizer=torch.optim.SGD(model.parameters())
    )
    with pytest.raises(
        ValueError, match=r"strategy='deepspeed' with deepspeed=None; DeepSpeed needs both"
    ):
        accel.wrap_model(ctx, model, strategy="deepspeed")
    with pytest.raises(ValueError, match=r"strategy='auto' with deepspeed="):
        accel.wrap_model(ctx, model, deepspeed=opts)
    with pytest.raises(ValueError, match=r"takes no fsdp=, ddp="):
        accel.wrap_model(ctx, model, strategy="deepspeed", deepspeed=opts, ddp=accel.DDPOptions())
    with pytest.raises(TypeError, match=r"optimizer=str must be a torch.optim.Optimizer"):
        accel.DeepSpeedOptions(config={}, optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"micro_batch_size=0"):
        accel.DeepSpeedOptions(config={}, micro_batch_size=0)
    with pytest.raises(ValueError, match=r"config=None\) takes the launcher's DeepSpeed config"):
        accel.wrap_model(ctx, model, strategy="deepspeed", deepspeed=accel.DeepSpeedOptions())
    assert accel.deepspeed_engine(torch.optim.SGD(model.parameters())) is None


@pytest.mark.slow
def test_a_lock_left_by_a_killed_op_build_is_named_not_waited_on(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    stale = tmp_path / "deepspeed_shm_comm" / "lock"  # what torch's FileBaton leaves
    stale.parent.mkdir()
    stale.touch()
    run = subprocess.run(
        [sys.executable, "-c", "import accel; accel.build_deepspeed_ops()"],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert f"{stale} is left from a killed build" in run.stderr, run.stderr[-2000:]
    assert stale.exists()  # named, not removed, without remove_stale_lock=True
