"""`accel launch` with Accelerate's DeepSpeed YAML runs the same script on a DeepSpeed engine.

One script, unchanged, with `wrap_model(strategy="auto")`: launched with `distributed_type:
DEEPSPEED` it trains through a ZeRO-2 engine, launched with `MULTI_CPU` through DDP, and the
losses agree (fp32: DeepSpeed reduces the same sums; see tests/dist/test_deepspeed_dist.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import _env

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, torch
import torch.nn.functional as F
import accel
ctx = accel.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
# DeepSpeed takes the optimizer when it builds the engine; under DDP these options are unused.
ds = accel.DeepSpeedOptions(optimizer=optimizer, micro_batch_size=4)
model = accel.wrap_model(ctx, model, deepspeed=ds)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
losses = []
for step in range(6):
    rows = slice(8 * step + 4 * ctx.rank, 8 * step + 4 * ctx.rank + 4)
    with accel.accumulate(ctx, model, step) as sync:
        loss = F.mse_loss(model(x[rows]), y[rows])
        accel.scaled_backward(ctx, loss)
    if sync:
        accel.clip_grad_norm_(ctx, model, 1.0)
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
    losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump({"losses": losses, "engine": accel.deepspeed_engine(model) is not None,
               "accum": ctx.grad_accum_steps, "deepspeed": ctx.wrap.deepspeed}, f)
accel.shutdown(ctx)
"""

DEEPSPEED_YAML = """\
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
  offload_param_device: none
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  zero3_init_flag: false
num_processes: 2
use_cpu: true
mixed_precision: 'no'
"""


def _launch(tmp_path: Path, name: str, yaml: str, *flags: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    (tmp_path / f"{name}.yaml").write_text(yaml)
    (tmp_path / "script.py").write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "accel", "launch", "--config_file", f"{name}.yaml", *flags,
         "script.py", str(out)],
        env=_env(tmp_path), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_the_same_script_runs_on_deepspeed_from_accelerates_yaml(tmp_path: Path) -> None:
    ds = _launch(tmp_path, "ds", DEEPSPEED_YAML)
    ddp = _launch(
        tmp_path, "ddp", "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n",
        "--gradient_accumulation_steps", "2",
    )  # fmt: skip
    assert [r["engine"] for r in ds] == [True, True]
    assert [r["engine"] for r in ddp] == [False, False]
    assert ds[0]["accum"] == 2  # the section's gradient_accumulation_steps is the run's
    assert dict(ds[0]["deepspeed"])["zero_stage"] == 2
    assert ds[0]["losses"] == ds[1]["losses"]
    for a, b in zip(ds[0]["losses"], ddp[0]["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_deepspeed_flags_build_the_section_and_bad_keys_are_refused(tmp_path: Path) -> None:
    from accel.cli._launch import resolve_config, worker_environment
    from accel_cli import build_parser

    argv = ["launch", "--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
            "--gradient_clipping", "0.5", "--num_processes", "2", "s.py"]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    config = resolve_config(args)
    assert config.distributed_type == "DEEPSPEED"
    assert dict(config.deepspeed_config) == {
        "zero_stage": "3", "offload_optimizer_device": "cpu", "gradient_clipping": "0.5"
    }  # fmt: skip
    env = worker_environment(config)
    assert json.loads(env["ACCEL_DEEPSPEED_CONFIG"])["zero_stage"] == "3"
    from accel.cli._accelerate_env import accelerate_environment

    exported = accelerate_environment(config)[0]  # what Accelerate's launcher exports
    assert exported["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert exported["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert exported["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert exported["ACCELERATE_GRADIENT_CLIPPING"] == "0.5"
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 2\n")
    run = subprocess.run(
        [sys.executable, "-m", "accel", "launch", "--config_file", str(bad), "s.py"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0 and "unknown key 'zero_stag'" in run.stderr, run.stderr
