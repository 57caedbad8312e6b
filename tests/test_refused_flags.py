"""Every `accelerate launch` flag (Accelerate 1.15) that accel launch cannot honour is refused
by name with the reason, not "not a flag"; --same_network and --rdzv_conf are taken."""

from __future__ import annotations

import pytest

from accel_cli import build_parser
from accel_cli._refused import REFUSED


def _parse(argv: list[str]) -> object:
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize(
    ("flags", "name"),
    [(["--mpirun_hostfile", "hosts"], "mpirun_hostfile"), (["--mpirun-hostfile=hosts"],
     "mpirun_hostfile"), (["--mpirun_ccl", "2"], "mpirun_ccl"), (["-q"], "quiet"),
     (["--tpu"], "tpu"), (["--role", "w"], "role"),
     (["--megatron_lm_tp_degree", "2"], "megatron_lm_tp_degree"),
     (["--parallelism_config_cp_backend", "torch"], "parallelism_config_cp_backend")],
)  # fmt: skip
def test_an_accelerate_flag_accel_cannot_honour_is_refused_by_name(
    flags: list[str], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(["launch", "--num_processes", "2", *flags, "train.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == f"accel launch: error: --{name} (Accelerate's) is not supported: {REFUSED[name]}.\n"
    )


def test_every_accelerate_launch_flag_is_a_flag_of_accel_launch() -> None:
    # accelerate launch --help of Accelerate 1.15 (the venv's): none is "not a flag" any more.
    from accelerate.commands.launch import launch_command_parser

    accelerate = {
        s for a in launch_command_parser()._actions for s in a.option_strings if s.startswith("--")
    }
    parser = build_parser(["launch", "--use_fsdp", "--use_deepspeed"])
    launch = next(a for a in parser._actions if a.dest == "command").choices["launch"]  # type: ignore[attr-defined]
    ours = {s for a in launch._actions for s in a.option_strings}
    assert sorted(accelerate - ours) == []


def test_same_network_and_rdzv_conf_are_taken() -> None:
    args = _parse(["launch", "--same_network", "--rdzv_conf", "join_timeout=9", "train.py"])
    assert args.same_network is True and args.rdzv_conf == "join_timeout=9"  # type: ignore[attr-defined]


def test_the_hostfile_refusal_names_open_mpi_and_mpich_spellings() -> None:
    # Open MPI's mpirun has no -f; MPICH's Hydra takes -f (issue 43)
    assert "mpirun --hostfile HOSTFILE" in REFUSED["mpirun_hostfile"]
    assert "`mpirun -f HOSTFILE ...` (MPICH, Intel MPI)" in REFUSED["mpirun_hostfile"]
