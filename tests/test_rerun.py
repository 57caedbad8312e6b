"""How a pre-empted run ends (accel/_rerun.py): the engine's "run me again", chosen from its own
variables, overridable with `preemption(rerun=...)`; and a signal held from init_distributed.

Real signals to this process, one rank: the block's stop is agreed at once. The multi-process
and engine cases are in tests/dist/test_preemption_dist.py and tests/cli/test_slurm.py.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

import accel
from accel._rerun import PREEMPTED_EXIT_CODE, HeldSignal, hold_signals, plan_rerun, release_signals
from accel.preemption import Preemption

KUBERNETES = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": "0", "WORLD_SIZE": "2"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    ("environ", "joined", "how", "engine"),
    [({"SLURM_JOB_ID": "42"}, False, "requeue", "SLURM job 42"),
     ({**TORCHRUN, "SLURM_JOB_ID": "42"}, False, "requeue", "SLURM job 42"),  # launch in sbatch
     (KUBERNETES, False, "exit", "Kubernetes"), (TORCHRUN, False, "exit", "torchrun"),
     ({}, True, "raise", "Ray Train"), ({}, False, "exit", "the caller")],
)  # fmt: skip
def test_auto_reads_the_engine_from_its_own_variables(
    environ: dict[str, str], joined: bool, how: str, engine: str
) -> None:
    plan = plan_rerun("auto", environ, joined_group=joined)
    assert (plan.how, plan.engine, plan.exit_code) == (how, engine, PREEMPTED_EXIT_CODE)


def test_one_argument_overrides_it() -> None:
    slurm = {"SLURM_JOB_ID": "42"}
    assert plan_rerun(0, slurm, joined_group=False).how == "exit"  # a wrapper decides itself
    assert plan_rerun(75, slurm, joined_group=False).exit_code == 75
    assert plan_rerun("raise", slurm, joined_group=False).how == "raise"
    assert plan_rerun("requeue", slurm, joined_group=False).job_id == "42"
    with pytest.raises(ValueError, match=r"rerun='requeue' needs a SLURM job"):
        plan_rerun("requeue", {}, joined_group=False)
    for bad in ("later", True, 256, -1, 1.5):
        with pytest.raises(ValueError, match=rf"preemption: rerun={bad!r} is not a way"):
            plan_rerun(bad, {}, joined_group=False)


@pytest.fixture
def default_handlers() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _signalled_block(**kwargs: object) -> accel.Preemption:
    with accel.preemption(accel.RunContext(), **kwargs) as stop:  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested()
    return stop


def test_leaving_the_block_after_a_stop_exits_138(
    default_handlers: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as stopped:
        _signalled_block()
    assert stopped.value.code == 138
    err = capsys.readouterr().err
    assert "accel.preemption: pre-empted by SIGUSR1; exiting with code 138" in err


def test_an_exit_0_inside_the_block_after_a_stop_becomes_138(default_handlers: None) -> None:
    # what the docs said before: save, then sys.exit(0); the engine would read "finished"
    def save_then_exit_0() -> None:
        with accel.preemption(accel.RunContext()) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested()
            raise SystemExit(0)

    with pytest.raises(SystemExit) as stopped:
        save_then_exit_0()
    assert stopped.value.code == 138


def test_rerun_0_leaves_as_a_finished_run_and_raise_raises(default_handlers: None) -> None:
    assert _signalled_block(rerun=0).signal == "SIGUSR1"  # no exit: the script decides
    with pytest.raises(RuntimeError, match=r"Raised so that Ray Train's FailureConfig"):
        _signalled_block(rerun="raise")


def test_a_finished_loop_leaves_the_block_and_nothing_else(default_handlers: None) -> None:
    with accel.preemption(accel.RunContext()) as stop:
        assert not stop.requested()
    assert stop.signal is None


def test_a_signal_held_since_start_up_stops_the_first_step(default_handlers: None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    hold_signals()
    assert isinstance(signal.getsignal(signal.SIGTERM), HeldSignal)
    os.kill(os.getpid(), signal.SIGTERM)  # during start-up: held, not fatal
    with accel.preemption(accel.RunContext(), rerun=0) as stop:
        assert stop.received == "SIGTERM"
        assert stop.requested()
    with accel.preemption(accel.RunContext(), rerun=0) as again:
        assert not again.requested()  # taken once
    release_signals()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_with_a_notice_the_stop_asks_it_instead_of_combining_signals() -> None:
    # What accel.preemption gives the stop inside a Ray Train worker: ray.train's
    # get_preemption_info, agreed across workers by Ray (the Ray run is in
    # tests/dist/test_ray_train_dist.py); every `every`-th call asks it.
    answers = iter([None, {"preempted_ranks": [0, 1]}])
    stop = Preemption(accel.RunContext(), 2, notice=lambda: next(answers))
    assert [stop.requested() for _ in range(4)] == [False, False, False, True]
    assert stop.signal == "Ray Train's pre-emption notice" and stop.received is None
    assert stop.requested()  # stays True without asking again


def test_outside_the_main_thread_without_ray_it_is_refused() -> None:
    failed: list[BaseException] = []

    def enter() -> None:
        try:
            with accel.preemption(accel.RunContext()):
                pass
        except RuntimeError as err:
            failed.append(err)

    thread = threading.Thread(target=enter, name="loop")
    thread.start()
    thread.join()
    assert len(failed) == 1 and "entered in thread 'loop'" in str(failed[0])
