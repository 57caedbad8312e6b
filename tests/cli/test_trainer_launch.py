"""transformers' Trainer under `accel launch` sees the launch settings, as under `accelerate
launch`: 2 ranks on CPU, bf16, the same loss sequence from both launchers (issue 26 item 1:
it ran silently in fp32 before accel exported Accelerate's variables)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accel.cli._accelerate_env import accelerate_environment
from accel.config import parse_config
from tests.cli.test_cli import _env, accel_cli

SCRIPT = Path(__file__).with_name("trainer_script.py")
FLAGS = ("--num_processes", "2", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2")


def _reports(folder: Path) -> list[dict]:
    return [json.loads((folder / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_trainer_under_accel_launch_matches_accelerate_launch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")  # in the test extra; a bare install may lack it
    ours = accel_cli(tmp_path, "launch", *FLAGS, str(SCRIPT), str(tmp_path / "accel"))
    assert ours.returncode == 0, ours.stderr[-3000:]
    theirs = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", *FLAGS,
         str(SCRIPT), str(tmp_path / "accelerate")],
        env=_env(tmp_path) | {"HF_HOME": str(tmp_path / "hf")}, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    for report in _reports(tmp_path / "accel"):
        assert report["args_mixed_precision"] == "bf16"
        assert report["accelerator_mixed_precision"] == "bf16"
        assert (report["grad_accum"], report["world_size"]) == (2, 2)
    assert _reports(tmp_path / "accel") == _reports(tmp_path / "accelerate")
    assert "not transformers' Trainer" in ours.stderr  # accumulation: named, not dropped


def test_accelerate_variables_follow_the_config() -> None:
    env, warnings = accelerate_environment(parse_config({"mixed_precision": "no"}))
    assert env == {
        "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
    }  # fmt: skip
    assert warnings == []
    two = parse_config({"num_processes": 2})  # no GPU: Accelerate must join them on the CPU
    assert accelerate_environment(two, has_gpu=False)[0]["ACCELERATE_USE_CPU"] == "True"
    assert accelerate_environment(two, has_gpu=True)[0]["ACCELERATE_USE_CPU"] == "False"
    one = parse_config({})  # one process: DistributedType.NO, as use_cpu says
    assert accelerate_environment(one, has_gpu=False)[0]["ACCELERATE_USE_CPU"] == "False"
    config = parse_config({
        "distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
        "gradient_accumulation_steps": 4,
        "fsdp_config": {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "Block",
                        "fsdp_offload_params": False},
        "dynamo_config": {"dynamo_backend": "inductor"},
    })  # fmt: skip
    env, warnings = accelerate_environment(config)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"]) == ("true", "2")
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Block"
    assert env["FSDP_OFFLOAD_PARAMS"] == "false"
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert len(warnings) == 1 and "gradient_accumulation_steps=4" in warnings[0]


ACCELERATOR_SCRIPT = Path(__file__).with_name("accelerator_script.py")


def _full_batch_weights() -> list[float]:
    """accelerator_script.py's step, by hand, in one process on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(16.0).reshape(4, 4) / 10
    y = torch.arange(4.0).reshape(4, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    return model.weight.detach().flatten().tolist()


@pytest.mark.slow
def test_a_plain_accelerator_script_gets_one_world_of_two_processes(tmp_path: Path) -> None:
    """Issue 44 item 1: on a machine without GPUs each rank's Accelerator() saw
    DistributedType.NO and trained a full copy of its own, with no word."""
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", str(ACCELERATOR_SCRIPT),
                    str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    reports = _reports(tmp_path)
    expected = _full_batch_weights()
    for rank, report in enumerate(reports):
        assert (report["num_processes"], report["process_index"]) == (2, rank)
        assert report["distributed_type"] == "DistributedType.MULTI_CPU"
        assert report["gathered"] == [0.0, 1.0]
        assert report["weights"] == pytest.approx(expected, abs=1e-6)  # one DDP step
