"""examples/slurm.sbatch and examples/pytorchjob.yaml run real shells with the variables their
engine sets; the `accel launch` command lines they produce must parse and translate to the
torchrun arguments of a 2-machine x 8-process run. `srun`, `scontrol` and `accel` are stand-ins
on PATH that record what they were given (no cluster here)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from accel.cli import _launch
from accel_cli import build_parser

REPO = Path(__file__).resolve().parents[2]

# Runs its command once per node with that node's SLURM_NODEID, as `srun` with one task per
# node does (SLURM's srun(1), OUTPUT ENVIRONMENT VARIABLES).
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" || exit 1; done
"""
# `scontrol show hostnames node[07-08]`, its lines written apart as a long list's are: a reader
# that stops after the first line ends the pipe under scontrol (SIGPIPE)
FAKE_SCONTROL = """#!/bin/bash
echo node07; sleep 0.2; echo node08
"""
FAKE_ACCEL = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _fake_path(tmp: Path) -> str:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accel", FAKE_ACCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _recorded(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _torchrun_argv(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[str]:
    assert argv[0] == "launch"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp / "xdg"))  # no user config file
    monkeypatch.setenv("HF_HOME", str(tmp / "hf"))
    monkeypatch.chdir(REPO)  # the script path is relative to the checkout, as on the cluster
    args = build_parser(argv).parse_args(argv)
    return _launch.torchrun_argv(_launch.resolve_config(args), args)


def test_the_sbatch_file_starts_one_launcher_per_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.jsonl"
    env = {"PATH": _fake_path(tmp_path), "RECORD": str(record), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[07-08]", "HOME": str(tmp_path)}  # fmt: skip
    run = subprocess.run(["bash", str(REPO / "examples" / "slurm.sbatch")], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    launches = _recorded(record)
    assert len(launches) == 2
    for node, argv in enumerate(launches):
        torchrun = _torchrun_argv(argv, monkeypatch, tmp_path)
        assert torchrun[:6] == ["--nnodes", "2", "--nproc-per-node", "8", "--max-restarts", "1"]
        assert torchrun[8:14] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node07:29500",
                                  "--rdzv-id", "accel-node07:29500"]  # fmt: skip
        assert argv[argv.index("--machine_rank") + 1] == str(node)
        assert torchrun[-4:] == ["examples/char_lm.py", "--out", "runs/char-lm", "--resume"]
    text = (REPO / "examples" / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR1@90" in text  # what accel.preemption catches by default


def test_the_pytorchjob_pods_start_one_launcher_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest: Any = yaml.safe_load((REPO / "examples" / "pytorchjob.yaml").read_text())
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert [specs[r]["replicas"] for r in ("Master", "Worker")] == [1, 1]
    record = tmp_path / "record.jsonl"
    path = _fake_path(tmp_path)
    assert [specs[r]["restartPolicy"] for r in ("Master", "Worker")] == ["ExitCode"] * 2
    nproc = manifest["spec"]["nprocPerNode"]
    for rank, role in enumerate(("Master", "Worker")):
        container = specs[role]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator adds its variables to this one
        # What training-operator v1.7.0 sets in each pod (pkg/controller.v1/pytorch/envvar.go,
        # master.go): MASTER_* and PET_MASTER_*, WORLD_SIZE = pods x nprocPerNode, RANK and
        # PET_NODE_RANK = the pod's index (Master first), PET_NPROC_PER_NODE, PET_NNODES.
        env = {"PATH": path, "RECORD": str(record), "MASTER_ADDR": "char-lm-master-0",
               "MASTER_PORT": "23456", "PET_MASTER_ADDR": "char-lm-master-0",
               "PET_MASTER_PORT": "23456", "WORLD_SIZE": str(2 * int(nproc)), "RANK": str(rank),
               "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": "2",
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        run = subprocess.run(container["command"], env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert run.returncode == 0, run.stderr
    for rank, argv in enumerate(_recorded(record)):
        if rank == 0:  # machine 0 checks that its rendezvous port is free
            monkeypatch.setattr(_launch, "_check_port_free", lambda port: None)
        torchrun = _torchrun_argv(argv, monkeypatch, tmp_path)
        assert torchrun[:4] == ["--nnodes", "2", "--nproc-per-node", "8"]
        at = torchrun.index("--node-rank")
        assert torchrun[at : at + 6] == ["--node-rank", str(rank), "--master-addr",
                                         "char-lm-master-0", "--master-port", "23456"]  # fmt: skip
        assert torchrun[torchrun.index("--shutdown-timeout") + 1] == "100"  # < the grace period
