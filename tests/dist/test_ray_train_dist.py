"""Ray Train all the way, on a local Ray cluster with 2 CPU workers (one ray.init per module).

A TorchTrainer runs an accel loop: Ray creates the process group, accel joins it and uses the
rank, node rank and device Ray assigned; `save_state` checkpoints go to Ray through
`ray.train.report(checkpoint=...)`: from a shared folder in one run, from an s3:// bucket (the
suite's S3 server) in the other, with Ray's own storage in the bucket too. A worker that fails
once is restarted by Ray's FailureConfig and resumes from `ray.train.get_checkpoint()`; the run
must end with the losses and parameters, bit for bit, of an uninterrupted one.
`accel.shutdown` leaves Ray's group.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.processes import leftovers
from tests.s3_server import s3_environment

ray = pytest.importorskip("ray")  # the `ray` extra
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

STEPS = 6
pytestmark = [
    # Ray's own modules warn about their own deprecated options as they import.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # The driver runs only Ray here (accel runs in Ray's workers): ray.init keeps Popen objects
    # and pipes of the processes it starts, and drops them unclosed (or, when start-up times
    # out, still running: the fixture's check then names them), so the collector warns.
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


class History:
    """Loop state saved with the checkpoint: the step and the losses so far."""

    def __init__(self) -> None:
        self.step, self.losses = 0, []  # type: ignore[var-annotated]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": self.losses}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.losses = int(state["step"]), list(state["losses"])


def train_loop(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import accel

    scratch, fail_at = Path(config["scratch"]), config["fail_at"]
    root = config.get("root")  # a bucket's URL: checkpoints go there, Ray is told where
    if root is not None:
        os.environ.update(config["store_env"])  # the job's environment, as a cluster sets it
    ctx = accel.init_distributed(seed=0)
    accel.set_seed(0, ctx=ctx)
    model = accel.wrap_model(ctx, torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    history = History()
    state = {"model": model, "optimizer": optimizer, "history": history}
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        if root is not None:  # Ray's copy is in the bucket too: loaded from there
            accel.load_state(ctx, f"s3://{checkpoint.path}", state)
        else:
            with checkpoint.as_directory() as folder:
                accel.load_state(ctx, folder, state)
    while history.step < STEPS:
        x = torch.randn(8, 4)  # each rank's RNG stream is restored from the checkpoint
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        accel.scaled_backward(ctx, loss)
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
        history.step += 1
        history.losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
        if root is None:  # every rank writes its part into one folder (a shared disk)
            folder = scratch / f"step-{history.step}"
            accel.save_state(ctx, folder, state)
            reported = Checkpoint.from_directory(folder)
        else:  # every rank uploads its part under one prefix of the bucket
            url = f"{root}/step-{history.step}"
            accel.save_state(ctx, url, state)
            reported = Checkpoint(url.removeprefix("s3://"), filesystem=config["filesystem"])
        ray.train.report({"step": history.step}, checkpoint=reported if ctx.is_main else None)
        marker = scratch / "failed-once"
        if history.step == fail_at and ctx.rank == 1 and not marker.exists():
            marker.write_text("1")
            raise RuntimeError("a worker fails once")
    context = ray.train.get_context()
    seen = {
        "ranks": [ctx.rank, ctx.world_size, ctx.node_rank, ctx.local_rank],
        "ray": [context.get_world_rank(), context.get_world_size(), context.get_node_rank(),
                context.get_local_rank()],
        "device": [str(ctx.device), os.environ["ACCELERATE_TORCH_DEVICE"]],
        "device_source": ctx.sources["device"],
        "group_source": ctx.sources["process_group"],
    }  # fmt: skip
    accel.shutdown(ctx)
    seen["group_alive_after_shutdown"] = dist.is_available() and dist.is_initialized()
    params = [p.tolist() for p in accel.unwrap_model(model).parameters()]
    result = {"losses": history.losses, "params": params, **seen}
    (scratch / f"result-{ctx.rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def local_ray() -> Any:
    saved = dict(os.environ)
    try:
        env = {"env_vars": {"PYTHONPATH": str(Path(__file__).parents[2])}}
        # address="local": a cluster of this test's own, even where another Ray cluster runs on
        # the machine (plain ray.init() joins it, and refuses num_cpus then).
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env=env)  # fmt: skip
        yield
    finally:
        ray.shutdown()
        gc.collect()  # Ray's dropped pipes are collected here, under this module's filters
        # ray.init leaves variables in the driver (RAY_*, PYTHONBREAKPOINT): a later run_world
        # would see a start-up variable changed and spawn its ranks instead of forking them.
        os.environ.clear()
        os.environ.update(saved)
    # `ray stop` is not needed: ray.init started this cluster and ray.shutdown ends it
    leftover = [
        pid
        for pid in leftovers(os.getpid())
        if "ray" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert leftover == [], "Ray left processes running"


def _fit(tmp: Path, name: str, fail_at: int, bucket: str | None = None) -> list[dict[str, Any]]:
    """One fit; with `bucket` (an s3:// URL) the checkpoints and Ray's storage are there."""
    scratch = tmp / name
    scratch.mkdir()
    config: dict[str, Any] = {"scratch": str(scratch), "fail_at": fail_at}
    storage: dict[str, Any] = {"storage_path": str(tmp / "ray")}
    if bucket is not None:
        import pyarrow.fs
        import s3fs

        store_env = {k: os.environ[k] for k in s3_environment("")}
        client = s3fs.S3FileSystem(
            endpoint_url=store_env["AWS_ENDPOINT_URL"],
            key=store_env["AWS_ACCESS_KEY_ID"],
            secret=store_env["AWS_SECRET_ACCESS_KEY"],
        )  # Ray's own copies go through the same server, by pyarrow's fsspec bridge
        filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(client))
        root = f"{bucket}/{name}"
        config.update(root=root, store_env=store_env, filesystem=filesystem)
        storage = {"storage_path": f"{root.removeprefix('s3://')}/ray",
                   "storage_filesystem": filesystem}  # fmt: skip
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, failure_config=FailureConfig(max_failures=1), **storage),
    )
    trainer.fit()
    return [json.loads((scratch / f"result-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(900)  # two fits of a Ray cluster: 270 s on 2 loaded cores, over 300 in CI
def test_a_failed_worker_is_restarted_by_ray_and_resumes_exactly(
    tmp_path: Path, local_ray: None, s3: str
) -> None:
    reference = _fit(tmp_path, "uninterrupted", fail_at=0)  # checkpoints in a shared folder
    # Checkpoints in a bucket, reported to Ray from there (Ray's storage in the bucket too):
    # the restarted worker loads the one Ray gives back straight from the store.
    resumed = _fit(tmp_path, "failed-once", fail_at=3, bucket=s3)
    assert (tmp_path / "failed-once" / "failed-once").exists()  # it did fail, and was restarted
    for ref, got in zip(reference, resumed, strict=True):
        assert len(ref["losses"]) == STEPS
        assert (got["losses"], got["params"]) == (ref["losses"], ref["params"])  # bit for bit
    for rank, result in enumerate(reference):
        assert result["ranks"] == result["ray"] == [rank, 2, 0, rank]
        assert result["device"] == ["cpu", "cpu"]
        assert result["device_source"] == "launcher ACCELERATE_TORCH_DEVICE"
        assert result["group_source"].startswith("existing default group")
        assert result["group_alive_after_shutdown"] is True  # Ray's, destroyed by Ray
