"""Ray Train all the way, on a local Ray cluster: a head node and two worker nodes of 2 CPUs
each (one cluster per module).

A TorchTrainer runs an accel loop: Ray creates the process group, accel joins it and uses the
rank, node rank and device Ray assigned; `save_state` checkpoints go to Ray through
`ray.train.report(checkpoint=...)`: from a shared folder, or from an s3:// bucket (the suite's
S3 server) with Ray's own storage in the bucket too. A worker that fails once (its checkpoints
in the bucket) is restarted by Ray's FailureConfig and resumes from
`ray.train.get_checkpoint()`; a node Ray drains for
pre-emption (what `ray drain-node`, autoscaler v2 and KubeRay do on a spot reclaim) stops every
worker inside `accel.preemption` at one step through Ray's own notice, the loop saves a
just-in-time checkpoint, leaving the block raises, and FailureConfig's retry on the other node
resumes from it. Each run must end with the losses and parameters, bit for bit, of an
uninterrupted one. `accel.shutdown` leaves Ray's group.
"""

from __future__ import annotations

import gc
import json
import os
import time
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

    scratch, fail_at, drain_at = Path(config["scratch"]), config["fail_at"], config["drain_at"]
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
    node = ray.get_runtime_context().get_node_id()
    _log(scratch, {"start": ctx.rank, "step": history.step, "node": node})
    with accel.preemption(ctx) as stop:  # in Ray's training thread: Ray's notice, no signals
        while history.step < STEPS:
            x = torch.randn(8, 4)  # each rank's RNG stream is restored from the checkpoint
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            accel.scaled_backward(ctx, loss)
            accel.optimizer_step(ctx, optimizer)
            optimizer.zero_grad()
            history.step += 1
            history.losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
            if history.step == drain_at and ctx.rank == 0 and not (scratch / "drained").exists():
                (scratch / "drained").write_text(node)
                _drain(node)  # the cloud reclaims this node in 60 s: Ray tells every worker
            stopping = stop.requested()
            if stopping or config["report_every_step"]:
                reported = _save(ctx, config, state, history.step)
                ray.train.report(
                    {"step": history.step}, checkpoint=reported if ctx.is_main else None
                )
            if stopping:
                _log(scratch, {"stop": ctx.rank, "step": history.step, "signal": stop.signal})
                break  # leaving the block raises: FailureConfig retries, from this checkpoint
            marker = scratch / "failed-once"
            if history.step == fail_at and ctx.rank == 1 and not marker.exists():
                marker.write_text("1")
                raise RuntimeError("a worker fails once")
            if (scratch / "drained").exists():
                time.sleep(1.0)  # Ray's watcher polls every 0.5 s here: room for its notice
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


def _save(ctx: Any, config: dict[str, Any], state: Any, step: int) -> Checkpoint:
    """Every rank saves its part: into one folder (the workers share this disk), or under one
    prefix of the bucket, reported to Ray where it is."""
    import accel  # in Ray's worker, as train_loop imports it

    root = config.get("root")
    if root is None:
        folder = Path(config["scratch"]) / f"step-{step}"
        accel.save_state(ctx, folder, state)
        return Checkpoint.from_directory(folder)
    url = f"{root}/step-{step}"
    accel.save_state(ctx, url, state)
    return Checkpoint(url.removeprefix("s3://"), filesystem=config["filesystem"])


def _log(scratch: Path, event: dict[str, Any]) -> None:
    with (scratch / "events.jsonl").open("a") as events:
        events.write(json.dumps(event) + "\n")


def _drain(node: str) -> None:
    """Drain `node` for pre-emption with a deadline 60 s away, as `ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION` does (ray/scripts/scripts.py): Ray's own pre-emption notice."""
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = time.time_ns() // 1_000_000 + 60_000
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(node, reason, "a spot reclaim, for the test", deadline_ms)
    assert accepted, why


@pytest.fixture(scope="module")
def local_ray() -> Any:
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    cluster = None
    try:
        # The head node runs the driver, Ray Train's controller and its synchronisation actor
        # (pinned to the driver's node), no workers; two worker nodes: one drained for
        # pre-emption takes no new workers, so Ray's retry runs on the other one, as on a
        # cluster whose spot node is reclaimed. (A drained node that also held the controller
        # leaves the retry's synchronisation actor unschedulable in Ray 2.60.)
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 0, "include_dashboard": False})  # fmt: skip
        cluster.add_node(num_cpus=2)
        cluster.add_node(num_cpus=2)
        env = {"env_vars": {"PYTHONPATH": str(Path(__file__).parents[2]),
                            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}}  # fmt: skip
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
        yield
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        gc.collect()  # Ray's dropped pipes are collected here, under this module's filters
        # ray.init leaves variables in the driver (RAY_*, PYTHONBREAKPOINT): a later run_world
        # would see a start-up variable changed and spawn its ranks instead of forking them.
        os.environ.clear()
        os.environ.update(saved)
    # `ray stop` is not needed: the fixture started this cluster and cluster.shutdown ends it
    leftover = [
        pid
        for pid in leftovers(os.getpid())
        if "ray" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert leftover == [], "Ray left processes running"


def _fit(
    tmp: Path, name: str, *, fail_at: int = 0, drain_at: int = 0, bucket: str | None = None
) -> list[dict[str, Any]]:
    """One fit; with `bucket` (an s3:// URL) the checkpoints and Ray's storage are there."""
    scratch = tmp / name
    scratch.mkdir()
    config: dict[str, Any] = {"scratch": str(scratch), "fail_at": fail_at, "drain_at": drain_at,
                              "report_every_step": not drain_at}  # fmt: skip
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


def _events(scratch: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (scratch / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, local_ray: None) -> list[dict[str, Any]]:
    return _fit(tmp_path_factory.mktemp("ray"), "uninterrupted")


# Each fit: 20-50 s on this 2-core machine under load (one cluster, started once per module).
@pytest.mark.timeout(900)
def test_a_failed_worker_is_restarted_by_ray_and_resumes_exactly(
    tmp_path: Path, reference: list[dict[str, Any]], s3: str
) -> None:
    # Checkpoints in a bucket, reported to Ray from there (Ray's storage in the bucket too):
    # the restarted worker loads the one Ray gives back straight from the store; the reference
    # kept its checkpoints in a shared folder.
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


@pytest.mark.timeout(900)
def test_a_node_ray_preempts_stops_every_worker_at_one_step_and_the_retry_resumes_exactly(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    # Only the just-in-time checkpoint is reported: the retry can resume from nothing else.
    resumed = _fit(tmp_path, "preempted", drain_at=2)
    events = _events(tmp_path / "preempted")
    drained = (tmp_path / "preempted" / "drained").read_text()
    starts = [e for e in events if "start" in e]
    stops = sorted((e for e in events if "stop" in e), key=lambda e: e["stop"])
    assert [(e["stop"], e["signal"]) for e in stops] == [
        (0, "Ray Train's pre-emption notice"), (1, "Ray Train's pre-emption notice")
    ]  # fmt: skip
    step = stops[0]["step"]
    assert stops[1]["step"] == step and 2 <= step < STEPS  # the same step on every worker
    first, retry = starts[:2], starts[2:]
    assert [e["step"] for e in first] == [0, 0] and {e["node"] for e in first} == {drained}
    assert [e["step"] for e in retry] == [step, step]  # resumed from the stop's checkpoint
    assert drained not in {e["node"] for e in retry}  # on the other node
    for ref, got in zip(reference, resumed, strict=True):
        assert (got["losses"], got["params"]) == (ref["losses"], ref["params"])  # bit for bit
