"""The machinery of `accel.testing.run_world` and `accel.notebook_launch`: a store on port 0,
one process per rank (spawned through a forkserver, or forked), the deadline that kills every
rank with its children, and the first rank's error re-raised in the caller.

Shared below `testing` and `notebook`, whose public functions check their arguments and call
`start_world`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from accel._canary import CANARY_DEVICE, DeviceCanary, canary_device
from accel._exit import drain_gloo_workers, register_exit_guard
from accel._mesh import with_mesh
from accel._typing import Backend
from accel.context import Parallelism, RunContext


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a `run_world` rank."""

    def __str__(self) -> str:
        return str(self.args[0])


class _CallerStreams:
    """The caller's stdout and stderr, handed to a rank the forkserver starts.

    A forkserver's children inherit the server's own stdout and stderr: those of whatever the
    caller's were when the server started (under pytest, another test's capture). Pickled for
    the child, this duplicates the caller's two descriptors into it as they are now, as a
    spawned or forked rank would have them; `attach` puts them in place.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_attached_streams, (DupFd(1), DupFd(2)))


def _attached_streams(out: Any, err: Any) -> None:
    """In the rank: the caller's stdout and stderr become this process's 1 and 2."""
    for source, target in ((out, 1), (err, 2)):
        fd = source.detach()
        os.dup2(fd, target)
        os.close(fd)


def _worker(
    call: bytes | tuple[Callable[..., Any], tuple[Any, ...]],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    outdir: str,
    parallelism: Parallelism | None,
    device_type: str = "cpu",
    environ: dict[str, str] | None = None,
    canary: bool = False,
    streams: object = None,
) -> None:
    # `streams`, from the forkserver: unpickling it already attached the caller's stdout and
    # stderr (see _CallerStreams).
    if environ is not None:  # a rank from the forkserver: the caller's variables, as spawned
        os.environ.clear()
        os.environ.update(environ)
    # A rank killed by a fatal signal (a C++ abort, a segfault) raises nothing to report: print
    # every thread's Python stack on stderr first, so the caller's output names the frame.
    faulthandler.enable(all_threads=True)
    # A process group of its own: killing the rank at the deadline takes the DataLoader workers
    # (and any other children) it started with it.
    os.setpgrp()
    # Starting left this process's default start method at ours; a rank started by torchrun
    # is a fresh interpreter with the platform's default, which its DataLoader workers use
    # (spawning them re-imports everything: seconds per worker instead of milliseconds).
    mp.set_start_method(None, force=True)
    out = Path(outdir)
    timeout = timedelta(seconds=timeout_s)
    # notebook_launch on GPUs: a forked rank per GPU, over NCCL.
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    device = CANARY_DEVICE if canary else device
    backend: Backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        if device_type == "cuda":
            torch.cuda.set_device(device)
        store = TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        # A step that never calls an accel collective (say, tensor parallelism through DTensor
        # alone) would otherwise leave gloo's threads running at exit: pytorch/pytorch#190489.
        register_exit_guard()
    except BaseException:
        _record_error(out, rank)
        raise SystemExit(1) from None
    ctx = RunContext(
        rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
        device=device, backend=backend, timeout=timeout,
        sources={"process_group": "accel.testing.run_world"},
    )  # fmt: skip
    try:
        with DeviceCanary(nccl=True) if canary else contextlib.nullcontext():
            result = _call(call, ctx, rank, parallelism)
    except BaseException:
        # Recorded before the group goes down (which makes the other ranks fail too), so the
        # first rank to raise is the one with the earliest error record.
        _record_error(out, rank)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():  # fn may have called accel.shutdown(ctx) itself
            drain_gloo_workers()  # as accel.shutdown does, so the rank exits promptly
            dist.destroy_process_group()
    _write(out / f"{rank}.result", result)


def _call(
    call: bytes | tuple[Callable[..., Any], tuple[Any, ...]],
    ctx: RunContext,
    rank: int,
    parallelism: Parallelism | None,
) -> bytes:
    # Unpickled here rather than by multiprocessing before this function runs, so a function
    # the fresh interpreter cannot import is reported like any other error of the rank.
    try:
        fn, args = pickle.loads(call) if isinstance(call, bytes) else call
    except Exception as err:
        raise RuntimeError(
            f"run_world: rank {rank} could not import fn ({type(err).__name__}: {err}); a "
            "spawned rank imports fn by module and name: define it at the top level of a "
            "module or script file (not in `python -c`, stdin or a notebook cell)."
        ) from err
    if parallelism is not None:
        ctx = with_mesh(ctx, parallelism, source="accel.testing.run_world")
    return pickle.dumps(fn(ctx, *args))  # a result that cannot be pickled is an error too


def _record_error(out: Path, rank: int) -> None:
    when, (kind, err, _) = time.monotonic_ns(), sys.exc_info()
    text = traceback.format_exc()
    try:
        pickled = pickle.dumps(err)
    except Exception:  # the exception itself may not pickle; its text is kept
        pickled = b""
    summary = f"{kind.__name__ if kind else 'Exception'}: {err}"
    _write(out / f"{rank}.error", pickle.dumps((when, pickled, summary, text)))


def _unpickle_error(pickled: bytes, summary: str) -> BaseException:
    try:
        err = pickle.loads(pickled) if pickled else None
    except Exception:  # e.g. an exception class whose __init__ wants other arguments
        err = None
    return err if isinstance(err, BaseException) else RuntimeError(summary)


def _write(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(path)  # atomic: the parent never reads half a file


def start_world(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float,
    args: tuple[Any, ...],
    parallelism: Parallelism | None,
    *,
    start_method: str = "forkserver",
    device_type: str = "cpu",
    caller: str = "run_world",
) -> list[Any]:
    """The machinery of `run_world` and `accel.notebook_launch`, arguments already checked:
    the store on port 0, one process per rank, the deadline, the first error re-raised."""
    # A forked rank inherits fn and args as they are (closures included); a spawned one gets
    # them pickled, and unpickles them itself so that a failed import is reported as its error.
    call: bytes | tuple[Callable[..., Any], tuple[Any, ...]] = (fn, tuple(args))
    if start_method != "fork":
        try:
            call = pickle.dumps(call)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                f"{caller}: fn={fn!r} (with its args) cannot be sent to the spawned ranks "
                f"({err}); define fn at the top level of an importable module and pass "
                "picklable args."
            ) from err
    start: Any = _context(start_method)
    # A forkserver's children have the server's environment: send them the caller's.
    environ = dict(os.environ) if start.get_start_method() == "forkserver" else None
    store = TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="accel-run-world-") as outdir:
        procs = [
            start.Process(
                target=_worker,
                args=(
                    call,
                    rank,
                    world_size,
                    store.port,
                    timeout,
                    outdir,
                    parallelism,
                    device_type,
                    environ,
                    canary_device() is not None,
                    _CallerStreams() if environ is not None else None,
                ),
                name=f"accel-rank-{rank}",
                # Not daemonic, so a rank can start DataLoader workers; the `finally` below
                # kills what is left of every rank, children included.
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            _join(procs, timeout, Path(outdir), caller)
        finally:
            for p in procs:
                if p.is_alive() or p.exitcode != 0:
                    _kill_tree(p)
                p.join()
        return [
            pickle.loads((Path(outdir) / f"{r}.result").read_bytes()) for r in range(world_size)
        ]


# Variables read when an interpreter starts or torch is imported, not later: a forkserver's
# ranks have the values the server started with, whatever the caller has set since.
_READ_AT_START = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GLOO_", "NCCL_", "CUDA_", "LD_",
                  "PYTHON", "DNNL_", "ONEDNN_")  # fmt: skip


def _context(start_method: str) -> Any:
    """The multiprocessing context for `start_method`. A forkserver preloads torch,
    torch._dynamo and accel, which each rank would otherwise import; where the platform has
    none, or a variable read at start-up (`_READ_AT_START`) changed since the server started,
    the ranks are spawned."""
    if start_method != "forkserver":
        return mp.get_context(start_method)
    if start_method not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context, started_with = _forkserver()
    return context if _start_up_variables() == started_with else mp.get_context("spawn")


@functools.cache  # one forkserver per process, as multiprocessing keeps it
def _forkserver() -> tuple[Any, Mapping[str, str] | None]:
    """The forkserver context, and the start-up variables of its server, which starts with the
    first world started from it: right after this first call. None where other code of this
    process started the server first: its variables and preload are unknown, so never used."""
    from multiprocessing import forkserver  # here: only where the platform has one

    context = mp.get_context("forkserver")
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:  # already running
        return context, None
    # read when the server starts; DDP and FSDP import torch._dynamo (1.5 s of CPU per rank)
    context.set_forkserver_preload(["torch", "torch._dynamo", "accel"])
    return context, MappingProxyType(_start_up_variables())


def _start_up_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_START)}


def _kill_tree(proc: Any) -> None:
    """Kill a rank and every process in its process group (its DataLoader workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the rank had not made its group yet, or all of it is gone
        if proc.is_alive():
            proc.kill()


def _join(procs: list[Any], timeout: float, outdir: Path, caller: str) -> None:
    deadline = time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{caller}: ranks {sorted(running.values())} were still running after "
                f"timeout={timeout}s; they were killed. A rank is probably waiting in a "
                "collective the others never called."
            )
        for sentinel in wait(list(running), timeout=left):
            rank = running.pop(sentinel)
            # Whatever the rank left behind (DataLoader workers of a rank that crashed) dies
            # now, while the unreaped rank still holds its pid, so no reused pid is hit.
            _kill_tree(procs[rank])
            procs[rank].join()
            if procs[rank].exitcode != 0:
                _raise_rank_error(procs, rank, outdir)


def _raise_rank_error(procs: list[Any], rank: int, outdir: Path) -> None:
    errors = sorted((*pickle.loads(f.read_bytes()), int(f.stem)) for f in outdir.glob("*.error"))
    if not errors:
        code = procs[rank].exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise RuntimeError(
            f"run_world: rank {rank} {how} before it could report an error (a crash in native "
            "code, a kill, or a failure while the spawned interpreter started: its traceback is "
            "on stderr above; a script calling run_world must do so under "
            "`if __name__ == '__main__':`)."
        )
    _, pickled, summary, text, first = errors[0]  # the earliest failure caused the others
    err = _unpickle_error(pickled, summary)
    raise err from RemoteTraceback(f"rank {first} of {len(procs)} raised:\n{text}")
