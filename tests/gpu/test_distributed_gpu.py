"""init_distributed under a one-process torchrun: the device, a barrier, every collective."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_torchrun_worker.py")


def test_one_process_torchrun_runs_every_collective_on_the_device(
    device: torch.device, tmp_path: Path
) -> None:
    out = tmp_path / "seen.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = (
            ""  # the dry run's rank picks the CPU as the GPU run's picks cuda:0
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(WORKER), str(out)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(out.read_text())
    assert seen["device"] == str(device)
    assert seen["leaf_devices"] == [str(device)]  # every result stays on the run's device
    assert seen["cuda_initialized"] == (device.type == "cuda")
    assert seen["world_size"] == 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    assert seen["backend"] == [backend, backend]
    assert seen["all_reduce"] == [1.0] * 4
    assert "launcher torchrun" in seen["describe"]
    assert f"device           = device(type='{device.type}'" in seen["describe"]
    x = torch.arange(6.0).view(3, 2).tolist()
    assert seen["values"] == {
        "gather": {"x": x, "ids": [4, 5]},
        "reduce_mean": x,
        "reduce_sum": [x, x],
        "broadcast": {"x": x, "ids": [4, 5]},
        "pad": x,
        "split": x,
    }
    assert seen["gather_object"] == [{"rank": 0}]
    assert seen["broadcast_object"] == [1, "two"]
    assert seen["any_rank"] == [False, True]
