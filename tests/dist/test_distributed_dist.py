"""Process control, seeding, logging, init_distributed and run_world in real processes.

`_processes` runs every helper once per world size (1, 2, 4) and the tests check what each rank
saw, and the files the ranks wrote, against values written out by hand. init_distributed is
started as plain processes with a torchrun-like and a SLURM-like environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from accel import (
    RunContext,
    any_rank,
    broadcast,
    gather,
    get_logger,
    local_main_process_first,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    reduce,
    run_on_main,
    set_seed,
    shutdown,
    split_between_processes,
    wait_for_everyone,
)
from accel.testing import RemoteTraceback, run_world

pytestmark = pytest.mark.dist


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:  # O_APPEND: whole short lines from concurrent writers
        f.write(f"{time.monotonic_ns()} {line}\n")


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _two_contexts(ctx: RunContext) -> dict[str, Any]:
    # Pairs of ranks form sub-groups (at 2 ranks: a second group over both ranks); every rank
    # must create every group, in the same order.
    r, n = ctx.rank, ctx.world_size
    pairs = [[0, 1]] if n == 2 else [[0, 1], [2, 3]]
    groups = [dist.new_group(p) for p in pairs]
    pair = ctx.rank // 2
    sub = dataclasses.replace(
        ctx, rank=r % 2, local_rank=r % 2, world_size=2, local_world_size=2,
        process_group=groups[pair],
    )  # fmt: skip
    out = {
        "sub_gather": gather(sub, torch.tensor([r])).tolist(),
        "world_gather": gather(ctx, torch.tensor([r])).tolist(),
        "sub_broadcast": broadcast(sub, torch.tensor([r]), src=1).tolist(),
        "sub_reduce": reduce(sub, torch.tensor([r]), op="sum").tolist(),
    }
    shutdown(sub)  # destroys the sub-group only
    out["world_after_sub_shutdown"] = gather(ctx, torch.tensor([r])).tolist()
    return out


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    """Poll until another rank has written `path` (an event, not a guess at how long it takes)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never appeared")
        time.sleep(0.001)


def _processes(ctx: RunContext, tmp: str) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    d = Path(tmp)
    out: dict[str, Any] = {}
    # wait_for_everyone: the other ranks arrive only once rank 0 is at the barrier, so rank 0
    # sees their files after it only if the barrier really waited for them (no sleeps).
    if r == 0:
        (d / "rank0_at_barrier").write_text("")
    else:
        _wait_for(d / "rank0_at_barrier")
        (d / f"arrived{r}").write_text("")
    wait_for_everyone(ctx)
    out["arrived"] = sorted(p.name for p in d.glob("arrived*"))
    # main_process_first: rank 0's body runs until every other rank is at the gate; none of
    # them may enter its own body before rank 0 has left.
    if r != 0:
        (d / f"at_gate{r}").write_text("")
    with main_process_first(ctx):
        _append(d / "first.log", f"enter {r}")
        if r == 0:
            for k in range(1, n):
                _wait_for(d / f"at_gate{k}")
        _append(d / "first.log", f"exit {r}")
    # ... and releases the others when its body raises.
    try:
        with main_process_first(ctx):
            if r == 0:
                raise KeyError("rank 0 failed inside main_process_first")
            _append(d / "after_raise.log", f"ran {r}")
    except KeyError:
        out["raised"] = True
    wait_for_everyone(ctx)

    @on_main_process(ctx)
    def decorated(x: int) -> int:
        _append(d / "main_only.log", f"decorated {r}")
        return x * 10

    out["on_main_process"] = decorated(4)
    out["run_on_main"] = run_on_main(ctx, pow, 2, 5)
    out.update(_local_and_other_ranks(ctx, d))
    items = list(range(7))
    out["split"] = split_between_processes(ctx, items)
    out["split_pad"] = split_between_processes(ctx, items, pad=True)
    out["split_dict"] = split_between_processes(ctx, {"a": items, "b": list("abcdefg")})
    out["split_tensor"] = split_between_processes(ctx, torch.arange(7), pad=True).tolist()
    out["any_last"] = any_rank(ctx, r == n - 1)
    out["any_none"] = any_rank(ctx, False)
    out["seed_per_rank"] = set_seed(100, ctx=ctx)
    out["rand_per_rank"] = torch.rand(3).tolist()
    out["py_np_per_rank"] = [random.random(), float(np.random.rand())]
    out["seed_same"] = set_seed(100)
    out["rand_same"] = torch.rand(3).tolist()
    logger = logging.getLogger(f"accel.test.rank{r}")
    handler = _ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    log = get_logger(ctx, logger.name)
    log.info("main only")
    log.warning("every rank", main_process_only=False)
    log.debug("below the level", main_process_only=False)
    out["log"] = handler.messages
    if n > 1:
        out.update(_two_contexts(ctx))
    shutdown(ctx)
    out["initialized_after_shutdown"] = dist.is_initialized()
    return out


def _local_and_other_ranks(ctx: RunContext, d: Path) -> dict[str, Any]:
    # Two processes per machine: at 4 ranks, two machines whose local mains are ranks 0 and 2.
    r, n = ctx.rank, ctx.world_size
    per_node = min(n, 2)
    local = dataclasses.replace(
        ctx, local_rank=r % per_node, local_world_size=per_node, node_rank=r // per_node,
        num_nodes=n // per_node,
    )  # fmt: skip
    # local_main_process_first: every local main is inside its body at once (rank 0 waits
    # there for the other machine's local main, which would never come if it were held), and
    # the other ranks enter only after they have left.
    if not local.is_local_main:
        (d / f"local_gate{r}").write_text("")
    with local_main_process_first(local):
        _append(d / "local_first.log", f"enter {r}")
        if local.is_local_main:
            (d / f"local_in{r}").write_text("")
            for k in range(0, n, per_node):
                _wait_for(d / f"local_in{k}", timeout_s=30)
            for k in range(n):
                if k % per_node:
                    _wait_for(d / f"local_gate{k}", timeout_s=30)
        _append(d / "local_first.log", f"exit {r}")
    try:
        with local_main_process_first(local):
            if local.is_local_main and local.node_rank == local.num_nodes - 1:
                raise KeyError("a local main failed inside local_main_process_first")
    except KeyError:
        raised = True
    else:
        raised = False
    wait_for_everyone(ctx)
    return {
        "local_raised": raised,
        "on_local_main": on_local_main_process(local)(lambda: r)(),
        "on_last": on_last_process(ctx)(lambda: r)(),
        "on_process": [on_process(ctx, k)(lambda: r)() for k in range(n)],
    }


@pytest.fixture(scope="module", params=[1, 2, 4])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Path, list[dict[str, Any]]]:
    n = request.param
    tmp = tmp_path_factory.mktemp(f"world{n}")
    return n, tmp, run_world(_processes, world_size=n, timeout=120, args=(str(tmp),))


def _lines(path: Path) -> list[str]:
    stamped = [line.split(" ", 1) for line in path.read_text().splitlines()]
    return [text for _, text in sorted(stamped, key=lambda s: int(s[0]))]


def test_wait_for_everyone_waits_for_late_ranks(world: Any) -> None:
    n, _, results = world
    assert [res["arrived"] for res in results] == [sorted(f"arrived{k}" for k in range(1, n))] * n


def test_main_process_first_orders_bodies_and_survives_a_raise(world: Any) -> None:
    n, tmp, results = world
    lines = _lines(tmp / "first.log")
    assert lines[:2] == ["enter 0", "exit 0"]
    assert sorted(lines[2:]) == sorted(f"{e} {k}" for k in range(1, n) for e in ("enter", "exit"))
    assert [res.get("raised", False) for res in results] == [True] + [False] * (n - 1)
    ran = _lines(tmp / "after_raise.log") if n > 1 else []
    assert sorted(ran) == [f"ran {k}" for k in range(1, n)]


def test_main_only_helpers(world: Any) -> None:
    n, tmp, results = world
    assert [res["on_main_process"] for res in results] == [40] + [None] * (n - 1)
    assert [res["run_on_main"] for res in results] == [32] + [None] * (n - 1)
    assert _lines(tmp / "main_only.log") == ["decorated 0"]


def test_local_main_process_first_and_the_other_rank_gates(world: Any) -> None:
    n, tmp, results = world
    mains = list(range(0, n, min(n, 2)))
    lines = _lines(tmp / "local_first.log")
    first = len(mains) * 2
    assert sorted(lines[:first]) == sorted(f"{e} {k}" for k in mains for e in ("enter", "exit"))
    others = [k for k in range(n) if k not in mains]
    assert sorted(lines[first:]) == sorted(f"{e} {k}" for k in others for e in ("enter", "exit"))
    assert [res["local_raised"] for res in results] == [k == mains[-1] for k in range(n)]
    expected_on_local_main = [k if k in mains else None for k in range(n)]
    assert [res["on_local_main"] for res in results] == expected_on_local_main
    assert [res["on_last"] for res in results] == [None] * (n - 1) + [n - 1]
    assert [res["on_process"] for res in results] == [
        [k if j == k else None for j in range(n)] for k in range(n)
    ]


SPLITS = {
    1: [[0, 1, 2, 3, 4, 5, 6]],
    2: [[0, 1, 2, 3], [4, 5, 6]],
    4: [[0, 1], [2, 3], [4, 5], [6]],
}


def test_split_between_processes(world: Any) -> None:
    n, _, results = world
    assert [res["split"] for res in results] == SPLITS[n]
    padded = [part + part[-1:] * (len(SPLITS[n][0]) - len(part)) for part in SPLITS[n]]
    assert [res["split_pad"] for res in results] == padded
    assert [res["split_tensor"] for res in results] == padded
    letters = "abcdefg"
    assert [res["split_dict"] for res in results] == [
        {"a": part, "b": [letters[i] for i in part]} for part in SPLITS[n]
    ]


def test_any_rank(world: Any) -> None:
    n, _, results = world
    assert [(res["any_last"], res["any_none"]) for res in results] == [(True, False)] * n


def test_set_seed_per_rank_and_shared(world: Any) -> None:
    n, _, results = world

    def rand(seed: int) -> list[float]:
        return torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist()

    assert [res["seed_per_rank"] for res in results] == [100 + k for k in range(n)]
    assert [res["rand_per_rank"] for res in results] == [rand(100 + k) for k in range(n)]
    assert [res["py_np_per_rank"] for res in results] == [
        [random.Random(100 + k).random(), float(np.random.RandomState(100 + k).rand())]
        for k in range(n)
    ]
    assert [(res["seed_same"], res["rand_same"]) for res in results] == [(100, rand(100))] * n


def test_get_logger_main_only_with_rank_prefix(world: Any) -> None:
    n, _, results = world
    if n == 1:
        assert results[0]["log"] == ["main only", "every rank"]
        return
    assert [res["log"] for res in results] == [
        ["[rank 0] main only", "[rank 0] every rank"],
        *[[f"[rank {k}] every rank"] for k in range(1, n)],
    ]


def test_two_contexts_in_one_process_do_not_mix(world: Any) -> None:
    n, _, results = world
    if n == 1:
        assert "sub_gather" not in results[0]
        return
    for r, res in enumerate(results):
        pair = [r - r % 2, r - r % 2 + 1]
        assert res["sub_gather"] == pair
        assert res["sub_broadcast"] == [pair[1]]
        assert res["sub_reduce"] == [sum(pair)]
        assert res["world_gather"] == res["world_after_sub_shutdown"] == list(range(n))


def test_shutdown_destroys_the_group(world: Any) -> None:
    n, _, results = world
    assert [res["initialized_after_shutdown"] for res in results] == [False] * n


# -- init_distributed under launchers, as plain processes ------------------------------------

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                "ACCEL_PRECISION", "ACCEL_CONFIG_FILE", "ACCEL_DEVICE")  # fmt: skip


def _free_port(low: int = 0, high: int = 0) -> int:
    for port in range(low, high) if high else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port")


def _launch(tmp: Path, mode: str, timeout: float, envs: list[dict[str, str]]) -> list[Any]:
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and "SLURM" not in k}
    root = str(Path(__file__).resolve().parents[2])
    base["PYTHONPATH"] = os.pathsep.join([root, base.get("PYTHONPATH", "")])
    script = str(Path(__file__).with_name("_launched.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, mode, str(tmp), str(timeout), str(rank), str(len(envs))],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank, env in enumerate(envs)
    ]
    outputs = [p.communicate(timeout=180)[0].decode() for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(len(envs))]


@pytest.fixture(scope="module")
def torchrun_like(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    port = str(_free_port())
    envs = [
        {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ACCEL_PRECISION": "bf16"}
        for r in range(2)
    ]  # fmt: skip
    return _launch(tmp_path_factory.mktemp("torchrun"), "timeout", 3.0, envs)


@pytest.fixture(scope="module")
def slurm_like(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    port = _free_port(15000 + os.getpid() % 4000, 20000)  # srun derives the port from the job id
    envs = [
        {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2",
         "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": str(port - 15000), "SLURM_STEP_ID": "0"}
        for r in range(2)
    ]  # fmt: skip
    return _launch(tmp_path_factory.mktemp("slurm"), "basic", 60.0, envs)


def test_init_distributed_under_a_torchrun_environment(torchrun_like: list[Any]) -> None:
    for r, rep in enumerate(torchrun_like):
        assert rep["topology"] == [r, r, 2, 2]
        assert rep["nodes"] == [0, 1]
        assert (rep["backend"], rep["precision"]) == ("gloo", "bf16")
        assert rep["sources"]["rank"] == "launcher torchrun"
        assert rep["sources"]["precision"] == "env ACCEL_PRECISION"
        assert "precision        = 'bf16'  (env ACCEL_PRECISION)" in rep["describe"]
        assert rep["gather"] == [1, 2, 3, 4]
        assert rep["any_rank"] is True
        assert rep["initialized_after_shutdown"] is False


def test_collective_timeout_fires_within_its_bound_naming_the_call(
    torchrun_like: list[Any],
) -> None:
    rep = torchrun_like[0]
    assert rep["error"].startswith(
        "wait_for_everyone: collective timed out after 0:00:03 on rank 0 of world_size=2"
    )
    assert 2.5 <= rep["elapsed"] < 3 + 10  # the bound, plus slack for a loaded machine


def test_init_distributed_under_slurm_without_torchrun(slurm_like: list[Any]) -> None:
    for r, rep in enumerate(slurm_like):
        assert rep["topology"] == [r, r, 2, 2]
        assert rep["sources"]["world_size"] == "launcher slurm"
        assert (rep["backend"], rep["precision"]) == ("gloo", "fp32")
        assert rep["gather"] == [1, 2, 3, 4]
        assert rep["any_rank"] is True
        assert rep["initialized_after_shutdown"] is False


# -- run_world's own guarantees --------------------------------------------------------------


def _raise_on_rank_1(ctx: RunContext) -> None:
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    wait_for_everyone(ctx)  # rank 0 waits; the failing rank's error must win


def test_a_failing_rank_surfaces_its_traceback() -> None:
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        run_world(_raise_on_rank_1, world_size=2, timeout=120)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 1 of 2 raised" in str(cause)
    assert "_raise_on_rank_1" in str(cause) and "ValueError: boom on rank 1" in str(cause)


def _returns_a_lambda(ctx: RunContext) -> Any:
    return lambda: ctx.rank  # cannot be pickled back to the parent


def test_a_result_that_cannot_be_sent_back_is_the_rank_s_error() -> None:
    # It used to be reported as "exited with code 1 without raising a Python exception".
    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle") as info:
        run_world(_returns_a_lambda, world_size=1, timeout=120)
    assert "rank 0 of 1 raised" in str(info.value.__cause__)


def test_a_function_the_ranks_cannot_import_is_reported_with_its_traceback() -> None:
    # Defined in `python -c`: a spawned interpreter cannot import it. The child raised, and
    # run_world said it had exited "without raising a Python exception".
    code = (
        "from accel.testing import run_world\n"
        "def fn(ctx):\n    return ctx.rank\n"
        "run_world(fn, world_size=1, timeout=120)\n"
    )
    # Now refused before any rank starts, naming the function, why, and the way out.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    refusal = "ValueError: run_world: fn='fn' is defined in an interactive"
    assert last.startswith(refusal), out.stderr
    assert "spawned processes cannot import" in last and "notebook_launch" in last


def _straggle(ctx: RunContext, tmp: str) -> int:
    if ctx.rank == 1:
        Path(tmp, "pid").write_text(str(os.getpid()))
        time.sleep(600)
    return ctx.rank


def test_a_straggler_is_killed_at_the_hard_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] were still running after timeout=8s"):
        run_world(_straggle, world_size=2, timeout=8, args=(str(tmp_path),))
    assert time.monotonic() - start < 8 + 10
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone: killed and reaped
