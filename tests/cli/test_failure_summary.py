"""How `accel launch` names the rank that failed first, from torchrun's own failure records."""

from __future__ import annotations

import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from accel.cli._launch import failure_summary
from accel_cli._worker import record


def _failure(tmp_path: Path, rank: int, exitcode: int, err: BaseException | None) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    if err is not None:
        record(err, str(path))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_rank_that_raised_first_is_named_whatever_the_agent_saw_first(tmp_path: Path) -> None:
    first = _failure(tmp_path, 1, 1, ValueError("boom on rank 1\nsecond line"))
    time.sleep(0.01)
    second = _failure(tmp_path, 0, 1, RuntimeError("collective failed"))
    stopped = _failure(tmp_path, 2, -15, None)  # stopped by the agent: no record
    summary = failure_summary({0: second, 1: first, 2: stopped}).splitlines()
    assert summary[-1] == "accel launch: rank 1 failed first: ValueError: boom on rank 1"
    assert summary[0] == (
        "accel launch: the script failed on ranks 0 (exited with code 1), 1 (exited with code 1), "
        "2 (killed by SIGTERM); its output is above."
    )


def test_without_records_a_failed_exit_outranks_a_kill(tmp_path: Path) -> None:
    killed = _failure(tmp_path, 0, -15, None)
    exited = _failure(tmp_path, 1, 3, None)
    summary = failure_summary({0: killed, 1: exited})
    assert summary.splitlines()[-1] == "accel launch: rank 1 failed first: exited with code 3"


def test_record_writes_torchs_error_file_format(tmp_path: Path) -> None:
    failure = _failure(tmp_path, 0, 1, KeyError("missing"))
    assert failure.message["message"] == "KeyError: 'missing'"  # as torch's own record
    assert failure.error_file_data["accel"]["time_ns"] > 0
