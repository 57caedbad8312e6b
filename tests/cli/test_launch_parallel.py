"""`accel launch` with Accelerate's FSDP and parallelism configs really shards the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli.test_cli import _env
from tests.test_config_parallel import ACCELERATE_FSDP

REPORT = """
import json, sys, torch
import accel
from torch.distributed.fsdp import FSDPModule
from tests.models import TP_PLAN, make_model, lm_loss
ctx = accel.init_distributed()
model = accel.wrap_model(ctx, make_model(), tp_plan=TP_PLAN if ctx.tp_size > 1 else None)
inner = accel.unwrap_model(model)
calls = [0]
inner.layers[0].attention.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
accel.scaled_backward(ctx, lm_loss(model, torch.randint(0, 32, (2, 9))))
accel.optimizer_step(ctx, opt)
meshes = {n: list(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else None
          for n, p in inner.named_parameters()}
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump({"meshes": meshes, "units": [isinstance(b, FSDPModule) for b in inner.layers],
               "attention_calls": calls[0], "sources": dict(ctx.sources),
               "sizes": [ctx.dp_size, ctx.tp_size]}, f)
accel.shutdown(ctx)
"""

PARALLELISM = """\
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_transformer_layer_cls_to_wrap: Block
num_processes: 4
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
use_cpu: true
"""


def _launch(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = _env(tmp_path)
    env["HF_HOME"] = str(tmp_path / "hf")
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    return subprocess.run(
        [sys.executable, "-m", "accel", "launch", *argv, str(script), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip


def _reports(folder: Path, n: int) -> list[dict]:
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(n)]


def test_an_accelerate_fsdp_default_config_shards_by_layer_class(tmp_path: Path) -> None:
    # Where `accelerate config` saved it; accel has no config of its own here.
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text(ACCELERATE_FSDP)
    out = _launch(tmp_path)
    assert out.returncode == 0, out.stderr
    for report in _reports(tmp_path, 2):
        assert set(map(tuple, report["meshes"].values())) == {("dp_shard",)}
        assert report["units"] == [True, True]  # fsdp_transformer_layer_cls_to_wrap: Block
        assert report["attention_calls"] == 2  # fsdp_activation_checkpointing: recomputed
        assert report["sources"]["fsdp"].startswith("env ACCEL_FSDP_")
        assert report["sizes"] == [2, 1]


def test_a_parallelism_config_runs_fsdp2_with_tensor_parallel(tmp_path: Path) -> None:
    config = tmp_path / "nd.yaml"
    config.write_text(PARALLELISM)
    out = _launch(tmp_path, "--config_file", str(config))
    assert out.returncode == 0, out.stderr
    for report in _reports(tmp_path, 4):
        assert report["meshes"]["layers.0.attention.wq.weight"] == ["dp_shard", "tp"]
        assert report["meshes"]["norm.weight"] == ["dp_shard"]
        assert report["units"] == [True, True] and report["attention_calls"] == 1
        assert report["sizes"] == [2, 2]


def test_unsupported_fsdp_flags_are_refused_by_name(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--use_fsdp", "--num_processes", "2", "--fsdp_version", "1")
    assert out.returncode == 2 and "fsdp_version='1' is not supported" in out.stderr
    out = _launch(tmp_path, "--num_processes", "2", "--tp_size", "3")
    assert out.returncode == 2 and "tp=3 does not multiply to world_size=2" in out.stderr
