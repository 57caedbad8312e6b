from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accel import (
    RunContext,
    any_rank,
    init_distributed,
    main_process_first,
    on_main_process,
    run_on_main,
    shutdown,
    split_between_processes,
    wait_for_everyone,
)
from accel._launcher import first_slurm_host, parse_launch_env


def ctx_of(rank: int, world_size: int) -> RunContext:
    return RunContext(rank=rank, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_split_between_processes_covers_items_in_order(world_size: int, n: int) -> None:
    items = list(range(n))
    parts = [split_between_processes(ctx_of(r, world_size), items) for r in range(world_size)]
    assert [x for p in parts for x in p] == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_split_between_processes_exact_layout_with_and_without_padding() -> None:
    items = ["a", "b", "c", "d", "e"]
    assert [split_between_processes(ctx_of(r, 2), items) for r in range(2)] == [
        ["a", "b", "c"],
        ["d", "e"],
    ]
    assert [split_between_processes(ctx_of(r, 4), items, pad=True) for r in range(4)] == [
        ["a", "b"],
        ["c", "c"],
        ["d", "d"],
        ["e", "e"],
    ]
    tensor_parts = [
        split_between_processes(ctx_of(r, 2), torch.arange(3), pad=True) for r in (0, 1)
    ]
    assert [p.tolist() for p in tensor_parts] == [[0, 1], [2, 2]]
    assert split_between_processes(ctx_of(1, 2), {"x": (1, 2, 3), "y": [4, 5, 6]}) == {
        "x": (3,),
        "y": [6],
    }


def test_split_between_processes_errors() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        split_between_processes(ctx_of(0, 2), {"x": [1], "y": [1, 2]})
    with pytest.raises(TypeError, match="items is a str"):
        split_between_processes(ctx_of(0, 2), "abc")


def test_main_only_helpers_on_hand_built_ranks() -> None:
    calls = []

    def record(x: int) -> int:
        calls.append(x)
        return x * 2

    assert on_main_process(ctx_of(0, 2))(record)(1) == 2
    assert on_main_process(ctx_of(1, 2))(record)(1) is None
    assert run_on_main(ctx_of(0, 2), record, 3) == 6
    assert run_on_main(ctx_of(1, 2), record, 3) is None
    assert calls == [1, 3]


def test_single_process_coordination_is_a_no_op() -> None:
    ctx = RunContext()
    wait_for_everyone(ctx)
    with main_process_first(ctx):
        pass
    assert any_rank(ctx, True) and not any_rank(ctx, False)


def test_collectives_on_a_multi_rank_context_without_group_explain_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"wait_for_everyone: the context has world_size=2 but"):
        wait_for_everyone(ctx_of(0, 2))


def test_init_distributed_as_plain_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "ACCEL_PRECISION", "ACCEL_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: fp16\ngradient_accumulation_steps: 4\nseed: 1\n")
    monkeypatch.setenv("ACCEL_GRAD_ACCUM_STEPS", "2")
    ctx = init_distributed(device="cpu", seed=9, config=config, timeout=5)
    assert (ctx.world_size, ctx.process_group, ctx.backend) == (1, None, None)
    assert (ctx.precision, ctx.grad_accum_steps, ctx.seed) == ("fp16", 2, 9)
    assert ctx.sources["precision"] == f"config {config}"
    assert ctx.sources["grad_accum_steps"] == "env ACCEL_GRAD_ACCUM_STEPS"
    assert ctx.sources["seed"] == "argument"
    assert ctx.sources["rank"] == "default"
    assert ctx.timeout is not None and ctx.timeout.total_seconds() == 5
    shutdown(ctx)


def test_a_backend_asked_for_in_a_one_process_run_makes_its_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # backend= was dropped at world size 1: a one-GPU run asking for nccl never touched NCCL.
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "ACCEL_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_distributed(device="cpu", backend="gloo")
    try:
        assert torch.distributed.is_initialized()
        assert torch.distributed.get_backend() == "gloo"
        assert torch.distributed.get_world_size() == 1
        assert (ctx.backend, ctx.sources["backend"]) == ("gloo", "argument")
        assert ctx.sources["process_group"] == "default group"
        wait_for_everyone(ctx)
    finally:
        shutdown(ctx)
    assert not torch.distributed.is_initialized()


def test_init_distributed_reads_accelerates_no_as_fp32() -> None:
    # docs/migration.md: Accelerator(mixed_precision="no") becomes precision="no" or "fp32".
    ctx = init_distributed(device="cpu", precision="no")
    assert (ctx.precision, ctx.sources["precision"]) == ("fp32", "argument")


def test_init_distributed_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match=r"timeout=-1 must be a positive number of seconds"):
        init_distributed(device="cpu", timeout=-1)


def test_torchrun_environment_is_parsed() -> None:
    env = {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1234",
    }  # fmt: skip
    launch = parse_launch_env(env)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == (
        "torchrun",
        5,
        1,
        8,
    )
    assert (launch.local_world_size, launch.node_rank, launch.num_nodes) == (4, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("h0", 1234)


def test_slurm_environment_is_parsed() -> None:
    env = {
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
        "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
    }  # fmt: skip
    launch = parse_launch_env(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (
        "slurm",
        3,
        4,
        1,
    )
    assert (launch.local_world_size, launch.node_rank, launch.num_nodes) == (2, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("gpu07", 15000 + 123456 % 5000)
    assert parse_launch_env({**env, "MASTER_PORT": "4000"}).master_port == 4000


def test_the_batch_script_of_a_several_task_job_is_not_rank_0() -> None:
    # `sbatch --ntasks=2` then `python train.py` without srun: the batch script has
    # SLURM_PROCID=0 and SLURM_NTASKS=2 but is in no job step; taken for rank 0 it waited for
    # a rank 1 that never starts, until the time limit (issue 43)
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n1"}
    with pytest.raises(
        ValueError,
        match=r"^init_distributed: SLURM_NTASKS=2 but this process is "
        r"not one of srun's tasks .* `srun python train.py` \(2 tasks\)",
    ):
        parse_launch_env(batch)
    assert parse_launch_env({**batch, "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"}).world_size == 2


def test_single_task_slurm_and_plain_runs_are_one_process() -> None:
    assert parse_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"
    assert parse_launch_env({}).world_size == 1


def test_bad_launcher_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        parse_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("n1", "n1"), ("n1,n2", "n1"), ("gpu[07-09,12]", "gpu07"), ("a[3],b[1-2]", "a3")],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


def test_a_pytorchjob_pod_is_its_own_node() -> None:
    # Kubeflow's PyTorchJob sets only these per pod, one process each (training-operator,
    # pkg/controller.v1/pytorch/envvar.go and master.go).
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    launch = parse_launch_env(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (
        2, 0, 3, 1,
    )  # fmt: skip
    assert (launch.node_rank, launch.num_nodes) == (2, 3)


@pytest.mark.parametrize(
    "env",
    [
        # Open MPI's mpirun (https://docs.open-mpi.org/en/v5.0.x/tuning-apps/environment-var.html)
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        # MPICH's and Intel MPI's Hydra mpiexec (PMI_*, MPI_LOCALRANKID, MPI_LOCALNRANKS)
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        # MVAPICH2's mpirun_rsh
        {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4",
         "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
    ],
)  # fmt: skip
def test_mpirun_environments_are_parsed(env: dict[str, str]) -> None:
    launch = parse_launch_env({**env, "MASTER_ADDR": "host0"})
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == ("mpi", 3, 1, 4)
    assert (launch.local_world_size, launch.node_rank, launch.num_nodes) == (2, 1, 2)
    assert (launch.master_addr, launch.master_port) == ("host0", 29500)  # Accelerate's port
    message = r"^init_distributed: MASTER_ADDR is not set for an mpirun world of 4 processes on "
    with pytest.raises(ValueError, match=message + r"several machines \(2 on this one\)"):
        parse_launch_env(env)


def test_mpirun_on_one_machine_meets_on_the_loopback() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    launch = parse_launch_env({**env, "MASTER_PORT": "4000"})
    assert (launch.master_addr, launch.master_port, launch.num_nodes) == ("127.0.0.1", 4000, 1)
    assert parse_launch_env({"OMPI_COMM_WORLD_SIZE": "1"}).launcher == "none"


def test_a_group_another_framework_made_is_joined_and_left_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What Ray Train's TorchTrainer does before the user's function runs
    # (ray/train/torch/config.py): it creates the default group, then sets torchrun's variables
    # plus NODE_RANK and ACCELERATE_TORCH_DEVICE.
    for var in ("SLURM_PROCID", "ACCEL_CONFIG_FILE", "GROUP_RANK", "ACCEL_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    ray_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "NODE_RANK": "0", "ACCELERATE_TORCH_DEVICE": "cpu"}  # fmt: skip
    for key, value in ray_env.items():
        monkeypatch.setenv(key, value)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        ctx = init_distributed(backend="gloo")
        assert (ctx.device, ctx.sources["device"]) == (
            torch.device("cpu"), "launcher ACCELERATE_TORCH_DEVICE",
        )  # fmt: skip
        assert ctx.sources["process_group"].startswith("existing default group")
        shutdown(ctx)
        assert torch.distributed.is_initialized()  # its creator destroys it, not accel
    finally:
        torch.distributed.destroy_process_group()


def test_ray_trains_node_rank_is_read() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "NODE_RANK": "1", "ACCELERATE_TORCH_DEVICE": "cuda:0"}  # fmt: skip
    launch = parse_launch_env(env)
    assert (launch.node_rank, launch.num_nodes, launch.device) == (1, 2, "cuda:0")
