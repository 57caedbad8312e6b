"""Under Kubeflow's TrainJob, torchrun's PET_* defaults are set for `torchrun`; `accel launch`
passes its own --nnodes etc., so variables that disagree with its settings are refused by name
(Kubeflow Trainer sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
PET_MASTER_PORT in every node's pod for `torchrun`, docs/scale-out.md)."""

from __future__ import annotations

import pytest

from accel.config import Config, check_launch_environment

TRAINJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}  # fmt: skip
AGREEING = Config(num_machines=2, num_processes=8, machine_rank=1,
                  main_process_ip="job-node-0-0.job", main_process_port=29400)  # fmt: skip


def test_agreeing_variables_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {**TRAINJOB, "PET_NPROC_PER_NODE": "auto"}.items():
        monkeypatch.setenv(var, value)
    check_launch_environment(AGREEING)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    check_launch_environment(AGREEING)


def test_disagreeing_variables_are_one_line_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in TRAINJOB.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as err:
        check_launch_environment(Config())  # `accel launch train.py`, no flags
    text = str(err.value)
    assert "\n" not in text and text.startswith("accel launch: torchrun's variables")
    assert "PET_NNODES=2 but num_machines=1" in text
    assert "PET_NPROC_PER_NODE=4 but num_processes=1 per machine" in text
    assert "PET_NODE_RANK=1 but machine_rank=0" in text
    assert "--num_machines $PET_NNODES" in text
    with pytest.raises(ValueError, match=r"PET_MASTER_PORT=29400 but main_process_port=29500\."):
        check_launch_environment(
            Config(num_machines=2, num_processes=8, machine_rank=1,
                   main_process_ip="job-node-0-0.job", main_process_port=29500)
        )  # fmt: skip


def test_a_pytorchjob_pod_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    # training-operator v1.7.0 sets PET_* in every PyTorchJob pod too, next to MASTER_ADDR,
    # MASTER_PORT, WORLD_SIZE (pods x nprocPerNode) and RANK (pkg/controller.v1/pytorch/
    # envvar.go, master.go); the refusal named only TrainJob (issue 43)
    pod = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "16", "RANK": "1",
           "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "PET_NNODES": "2",
           "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1"}  # fmt: skip
    for var, value in pod.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=r"set by Kubeflow's PyTorchJob since training-operator"):
        check_launch_environment(Config(num_machines=16, num_processes=16, machine_rank=1))
