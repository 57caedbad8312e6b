"""Kubernetes (Kubeflow) and mpirun: each engine's variables, as it sets them, make one world.

Two real processes per engine on the loopback form a gloo world with nothing but the
variables the engine's source or documentation sets, train three DDP steps, and must end with
the parameters of a one-process computation of the same steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli.test_cli import _env as cli_env
from tests.processes import leftovers

SCRIPT = """
import json, sys
import torch
import accel

ctx = accel.init_distributed(seed=0)
torch.manual_seed(0)
model = accel.wrap_model(ctx, torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + ctx.rank)
for _ in range(3):
    x = torch.randn(8, 4, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
params = [p.tolist() for p in accel.unwrap_model(model).parameters()]
report = {"topology": [ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size,
                       ctx.node_rank, ctx.num_nodes], "source": ctx.sources["rank"],
          "params": params, "ranks": accel.gather_object(ctx, ctx.rank)}
with open(f"{sys.argv[1]}/{ctx.rank}.json", "w") as f:
    json.dump(report, f)
accel.shutdown(ctx)
"""


def _reference() -> list[torch.Tensor]:
    """The same three steps in one process: DDP's mean of the two ranks' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    for _ in range(3):
        xs = [torch.randn(8, 4, generator=g) for g in gens]
        loss = sum((model(x) - x.sum(1, keepdim=True)).pow(2).mean() for x in xs) / 2
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _start(tmp: Path, argv: list[str], envs: list[dict[str, str]]) -> list[Any]:
    tmp.mkdir()
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    base = {k: v for k, v in cli_env(tmp).items() if k not in drop and "SLURM" not in k}
    return [
        subprocess.Popen([sys.executable, *argv, str(script), str(tmp)], env={**base, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        for env in envs
    ]  # fmt: skip


def _ports(n: int) -> list[str]:
    """n distinct free ports (each probed while the others are still held)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [str(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine's world, started at once (the four share the machine's start-up time)."""
    root = tmp_path_factory.mktemp("engines")
    plain, pet, ompi, mpich = _ports(4)
    # training-operator v1.7.0's PyTorchJob, one process per pod (nprocPerNode defaults to
    # "auto", counted as 1): MASTER_ADDR, MASTER_PORT and their PET_ twins
    # (pkg/controller.v1/pytorch/master.go), WORLD_SIZE = pods x nprocPerNode, RANK and
    # PET_NODE_RANK = the pod's index, master first, PET_NPROC_PER_NODE, PET_NNODES and
    # PYTHONUNBUFFERED (pkg/controller.v1/pytorch/envvar.go).
    pytorchjob = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": plain, "WORLD_SIZE": "2",
                   "RANK": str(r), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": plain,
                   "PET_NODE_RANK": str(r), "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2",
                   "PYTHONUNBUFFERED": "1"} for r in range(2)]  # fmt: skip
    # Kubeflow Trainer's torch plugin sets torchrun's PET_ defaults per pod (PET_NNODES,
    # PET_NPROC_PER_NODE, PET_NODE_RANK from the Job completion index, PET_MASTER_ADDR,
    # PET_MASTER_PORT: kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go), and the
    # pod runs `torchrun train.py`; torchrun reads PET_<ARG> as each argument's default
    # (torch/distributed/argparse_util.py, `env`).
    trainjob = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(r),
                 "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": pet}
                for r in range(2)]  # fmt: skip
    # What `mpirun -np 2 -x MASTER_PORT python train.py` gives each process on one machine.
    # Open MPI: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
    # (https://docs.open-mpi.org/en/v5.0.x/tuning-apps/environment-var.html). MPICH and Intel
    # MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS. Accelerate reads the
    # same (accelerate/utils/environment.py, get_cpu_distributed_information).
    openmpi = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_PORT": ompi} for r in range(2)]  # fmt: skip
    hydra = [{"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r),
              "MPI_LOCALNRANKS": "2", "MASTER_PORT": mpich} for r in range(2)]  # fmt: skip
    started = {
        "pytorchjob": _start(root / "pytorchjob", [], pytorchjob),
        "trainjob": _start(root / "trainjob", ["-m", "torch.distributed.run"], trainjob),
        "openmpi": _start(root / "openmpi", [], openmpi),
        "mpich": _start(root / "mpich", [], hydra),
    }
    results: dict[str, Any] = {}
    for name, procs in started.items():
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        codes = [p.returncode for p in procs]
        results[name] = (
            [json.loads((root / name / f"{r}.json").read_text()) for r in range(2)]
            if codes == [0, 0]
            else outputs
        )
    assert leftovers(os.getpid()) == []
    return results


def _check_world(reports: Any, topology: list[list[int]], source: str) -> None:
    assert isinstance(reports[0], dict), reports  # else: the processes' output
    assert [r["topology"] for r in reports] == topology
    assert {r["source"] for r in reports} == {source}
    assert reports[0]["ranks"] == [0, 1]
    assert reports[0]["params"] == reports[1]["params"]  # one model, replicated by DDP
    for got, want in zip(reports[0]["params"], _reference(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_pytorchjob_pods_with_plain_variables(worlds: dict[str, Any]) -> None:
    two_nodes = [[0, 0, 2, 1, 0, 2], [1, 0, 2, 1, 1, 2]]
    _check_world(worlds["pytorchjob"], two_nodes, "launcher torchrun")


def test_kubeflow_trainjob_pods_running_torchrun_with_pet_variables(
    worlds: dict[str, Any],
) -> None:
    two_nodes = [[0, 0, 2, 1, 0, 2], [1, 0, 2, 1, 1, 2]]
    _check_world(worlds["trainjob"], two_nodes, "launcher torchrun")


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_mpirun_on_one_machine(worlds: dict[str, Any], flavour: str) -> None:
    one_node = [[0, 0, 2, 2, 0, 1], [1, 1, 2, 2, 0, 1]]
    _check_world(worlds[flavour], one_node, "launcher mpi")


def test_mpirun_on_two_machines_without_master_addr_is_one_line(tmp_path: Path) -> None:
    # Open MPI's variables for rank 0 of 2 machines x 1 process, no MASTER_ADDR exported.
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}  # fmt: skip
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in cli_env(tmp_path).items() if k not in ("MASTER_ADDR", "RANK")}
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], env={**base, **env},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "ValueError: init_distributed: MASTER_ADDR is not set for an mpirun world of 2 processes "
        "on several machines (1 on this one); mpirun does not set a rendezvous address. Export "
        "rank 0's host as MASTER_ADDR (mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500)."
    )


@pytest.mark.parametrize(
    "engine",
    [{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
      "SLURM_NODELIST": "127.0.0.1"},
     {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}],
    ids=["srun", "mpirun"],
)  # fmt: skip
def test_a_busy_rendezvous_port_is_one_line_naming_it(
    tmp_path: Path, engine: dict[str, str]
) -> None:
    # before: a raw DistNetworkError traceback from the TCPStore (EADDRINUSE), no port named
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        base = {k: v for k, v in cli_env(tmp_path).items() if k not in ("RANK", "WORLD_SIZE")}
        run = subprocess.run(
            [sys.executable, "-c", "import accel; accel.init_distributed()"],
            env={**base, **engine, "MASTER_PORT": str(port)}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"RuntimeError: init_distributed: the rendezvous port MASTER_PORT={port} is in use on "
        "127.0.0.1 (another job, or a process of an earlier run); every rank must use the same "
        "free port: export another one as MASTER_PORT (srun: in the job's environment; mpirun: "
        "-x MASTER_PORT=PORT)."
    )
