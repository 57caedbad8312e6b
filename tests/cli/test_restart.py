"""`accel launch --max_restarts 1`: a rank dies once, the agent restarts the workers, and the
script resumes from its latest checkpoint to the parameters of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_cli import accel_cli

SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
import accel

out, die_at = Path(sys.argv[1]), int(sys.argv[2])
ctx = accel.init_distributed(seed=0)
accel.set_seed(0, ctx=ctx)
model = accel.wrap_model(ctx, torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": optimizer}
step = 0
if (latest := accel.latest_checkpoint(out / "ckpt")) is not None:
    accel.load_state(ctx, latest, **state)
    step = int(latest.name.split("-")[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
while step < 6:
    x = torch.randn(8, 4)  # the per-rank RNG stream is restored from the checkpoint
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    accel.scaled_backward(ctx, loss)
    accel.optimizer_step(ctx, optimizer)
    optimizer.zero_grad()
    step += 1
    accel.save_checkpoint(ctx, out / "ckpt", state, step=step, keep=1)
    if step == die_at and attempt == 0 and ctx.rank == 1:
        os._exit(3)  # a crash: no clean-up, no exception
if ctx.is_main:
    params = [p.tolist() for p in accel.unwrap_model(model).parameters()]
    (out / "result.json").write_text(json.dumps({"attempt": attempt, "params": params}))
accel.shutdown(ctx)
"""


def test_a_rank_that_dies_once_is_restarted_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    results = {}
    for name, die_at in (("uninterrupted", 0), ("crashed", 3)):
        out = tmp_path / name
        out.mkdir()
        run = accel_cli(
            tmp_path, "launch", "--num_processes", "2", "--max_restarts", "1",
            "--monitor_interval", "0.2", str(script), str(out), str(die_at),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        results[name] = json.loads((out / "result.json").read_text())
    assert results["uninterrupted"]["attempt"] == 0
    assert results["crashed"]["attempt"] == 1  # the agent restarted the workers once
    assert results["crashed"]["params"] == results["uninterrupted"]["params"]


def test_without_restarts_the_crash_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script), str(tmp_path), "3")
    assert run.returncode != 0
