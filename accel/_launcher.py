"""Pure parsing of the launcher contract: which process am I, and where is the rendezvous.

Kept free of `os.environ` so every launcher's layout is unit-tested from a plain dict;
`accel.distributed` passes the real environment in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["torchrun", "slurm", "mpi", "none"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """What the launcher told this process about the run's topology."""

    launcher: Launcher
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    device: str | None = None  # the device the launcher assigned (Ray's ACCELERATE_TORCH_DEVICE)


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"init_distributed: environment variable {key}={value!r} is not an integer; the "
            "launcher that set it is misconfigured."
        ) from None


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list such as ``"gpu[07-09,12],cpu1"``.

    Example:
        >>> first_slurm_host("gpu[07-09,12],cpu1")
        'gpu07'
    """
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"init_distributed: SLURM_NODELIST={nodelist!r} cannot be parsed.")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _check_slurm_step(environ: Mapping[str, str]) -> None:
    """SLURM_PROCID names a task only inside a job step (srun sets SLURM_STEP_ID); the batch
    script of `sbatch --ntasks=N` has SLURM_PROCID=0 and SLURM_NTASKS=N too, and taken for rank
    0 it would wait for N-1 ranks that never start, until the job's time limit."""
    if "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ:
        return
    tasks = environ["SLURM_NTASKS"]
    raise ValueError(
        f"init_distributed: SLURM_NTASKS={tasks} but this process is not one of srun's tasks "
        "(SLURM_STEP_ID is not set: it is the batch script itself); start the script with "
        f"`srun python train.py` ({tasks} tasks), or with `srun accel launch ...` one task per "
        "node."
    )


def _slurm_port(environ: Mapping[str, str]) -> int:
    # Every task must pick the same port without talking to the others: derive it from the job
    # id (as Lightning does) unless the user exported MASTER_PORT.
    if "MASTER_PORT" in environ:
        return _int(environ, "MASTER_PORT")
    return 15000 + _int(environ, "SLURM_JOB_ID") % 5000 if "SLURM_JOB_ID" in environ else 29500


def parse_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Read torchrun's variables, else SLURM's (srun without torchrun), else mpirun's, else one.

    torchrun's also covers a Kubeflow PyTorchJob pod (MASTER_ADDR, MASTER_PORT, RANK and
    WORLD_SIZE per pod). mpirun's follow Accelerate's rules: PMI_*, OMPI_COMM_WORLD_* or
    MV2_COMM_WORLD_*, MASTER_PORT 29500 unless set, MASTER_ADDR required on several machines.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world_size = _int(environ, "WORLD_SIZE")
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else 1
        num_nodes = (
            _int(environ, "GROUP_WORLD_SIZE")
            if "GROUP_WORLD_SIZE" in environ
            else max(1, world_size // local_world_size)
        )
        return LaunchEnv(
            launcher="torchrun",
            rank=_int(environ, "RANK"),
            local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            world_size=world_size,
            local_world_size=local_world_size,
            # torchrun's GROUP_RANK, else Ray Train's NODE_RANK (ray/train/torch/config.py);
            # without either (a Kubeflow PyTorchJob pod runs one process per pod with RANK and
            # WORLD_SIZE only) the node follows from the rank.
            node_rank=next(
                (_int(environ, key) for key in ("GROUP_RANK", "NODE_RANK") if key in environ),
                _int(environ, "RANK") // local_world_size,
            ),
            num_nodes=num_nodes,
            master_addr=environ.get("MASTER_ADDR"),
            master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
            # Ray Train's TorchTrainer sets the device it gave this worker (for Accelerate).
            device=environ.get("ACCELERATE_TORCH_DEVICE") or None,
        )
    if "SLURM_PROCID" in environ and _int(environ, "SLURM_NTASKS") > 1:
        _check_slurm_step(environ)
        world_size = _int(environ, "SLURM_NTASKS")
        num_nodes = _int(environ, "SLURM_NNODES") if "SLURM_NNODES" in environ else 1
        return LaunchEnv(
            launcher="slurm",
            rank=_int(environ, "SLURM_PROCID"),
            local_rank=_int(environ, "SLURM_LOCALID"),
            world_size=world_size,
            # SLURM_NTASKS_PER_NODE is only set when the job asked for it; fall back to an
            # even split, which is what srun does by default.
            local_world_size=(
                _int(environ, "SLURM_NTASKS_PER_NODE")
                if "SLURM_NTASKS_PER_NODE" in environ
                else max(1, world_size // num_nodes)
            ),
            node_rank=_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0,
            num_nodes=num_nodes,
            master_addr=environ.get("MASTER_ADDR")
            or first_slurm_host(environ.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=_slurm_port(environ),
        )
    mpi = _parse_mpi(environ)
    return mpi if mpi is not None else LaunchEnv(launcher="none")


# What mpirun sets, in the order Accelerate reads them (accelerate/utils/environment.py,
# get_cpu_distributed_information): MPICH and Intel MPI (Hydra), Open MPI, MVAPICH2.
_MPI_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_RANK = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def _first(environ: Mapping[str, str], keys: tuple[str, ...], default: int) -> int:
    return next((_int(environ, key) for key in keys if key in environ), default)


def _parse_mpi(environ: Mapping[str, str]) -> LaunchEnv | None:
    """mpirun's ranks; the rendezvous is MASTER_ADDR:MASTER_PORT (gloo or NCCL, not MPI's)."""
    world_size = _first(environ, _MPI_SIZE, 1)
    if world_size <= 1:
        return None
    local_world_size = _first(environ, _MPI_LOCAL_SIZE, 1)
    rank = _first(environ, _MPI_RANK, 0)
    master_addr = environ.get("MASTER_ADDR")
    if master_addr is None:
        if local_world_size != world_size:
            raise ValueError(
                f"init_distributed: MASTER_ADDR is not set for an mpirun world of {world_size} "
                f"processes on several machines ({local_world_size} on this one); mpirun does "
                "not set a rendezvous address. Export rank 0's host as MASTER_ADDR (mpirun -x "
                "MASTER_ADDR=host0 -x MASTER_PORT=29500)."
            )
        master_addr = "127.0.0.1"  # one machine: every rank meets on the loopback
    return LaunchEnv(
        launcher="mpi",
        rank=rank,
        local_rank=_first(environ, _MPI_LOCAL_RANK, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        # mpirun fills each machine's slots in turn by default (--map-by slot).
        node_rank=rank // local_world_size,
        num_nodes=max(1, world_size // local_world_size),
        master_addr=master_addr,
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500,
    )
