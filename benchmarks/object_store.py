"""Checkpoints to object storage: accel's upload of a training state against one plain `put`.

A ~500 MB training state (an fp32 model of `Linear(width, width)` layers and its AdamW moments)
in one process, against one S3-compatible server on 127.0.0.1: moto's, started here in its own
process (so the server parses and hashes beside the client, not under its interpreter lock),
reached through s3fs with AWS_ENDPOINT_URL as a user points it at a server. Every round runs
these groups, in an order rotated every round:

- by hand: one `put_object` of the same bytes (the state's tensors, concatenated), through the
  same s3fs client: one request, one stream;
- accel: `save_checkpoint(ctx, "s3://bench/run", state, step=n, keep=1)`, blocking: the state's
  safetensors uploaded from memory in 16 MiB parts, 8 at a time, each object checked (size,
  CRC32), the manifest written last; it returns once committed;
- accel's upload alone (`accel._store.transfer.upload`) of the same two files (the model's and
  the optimizer's safetensors, written once to a local folder), 1, 2, 4 and 8 parts in flight;
- `save_checkpoint(..., blocking=False)`: the time the call holds the caller (the state copied
  off the tensors, the store asked once), against the blocking save's whole time.

Ratio = by-hand time / accel time (>= 1: accel is faster), from the best round of each, with
medians and every round printed. Then where the time goes: the CPU seconds the client and the
server processes spent (from /proc) during one put and during one accel save, and the
cumulative time of the accel save's phases (cProfile).

    python benchmarks/object_store.py              # ~500 MB state, 3 rounds
    python benchmarks/object_store.py --quick      # ~25 MB, a few seconds
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import accel
from accel._safetensors.manifests import checksum_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks beside this one
from checkpoint import _setup

from accel._store import transfer
from accel._store.urls import locate


def _state(width: int, layers: int) -> dict[str, object]:
    model, opt = _setup(width, layers)  # the checkpoint benchmark's model and AdamW state
    return {"model": model, "optimizer": opt}


def _tensors(state: dict[str, object]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = state["model"]
    opt = state["optimizer"]
    assert isinstance(model, nn.Module) and isinstance(opt, torch.optim.Optimizer)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    moments = {
        f"{i}.{name}": t
        for i, s in enumerate(opt.state.values())
        for name, t in s.items()
        if t.dim() > 0
    }
    return weights, moments


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the moto server did not start within 60 s")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2304)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a ~25 MB state, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.rounds = 512, 8, 2
    server, endpoint = _server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        _run(args, server.pid)
    finally:
        server.kill()
        server.wait()


def _run(args: argparse.Namespace, server_pid: int) -> None:
    import fsspec

    ctx = accel.RunContext.single()
    fs = fsspec.filesystem("s3")
    fs.mkdir("bench")
    state = _state(args.width, args.layers)
    weights, moments = _tensors(state)
    payload = b"".join(bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in
                       (*weights.values(), *moments.values()))  # fmt: skip
    mb = len(payload) / 1e6
    print(f"state: {mb:.0f} MB (model {sum(t.nbytes for t in weights.values()) / 1e6:.0f} MB "
          f"+ AdamW moments); server {endpoint_of()}; {os.cpu_count()} cores")  # fmt: skip
    staged = Path(tempfile.mkdtemp())
    save_file(weights, staged / "model.safetensors")
    save_file(moments, staged / "optimizer.safetensors")
    files = {p.name: transfer.file_blob(p, *checksum_file(p)) for p in sorted(staged.iterdir())}
    remote = locate("bench", "url", "s3://bench/parts")
    step = 0

    def put() -> None:
        fs.call_s3("put_object", Bucket="bench", Key="by-hand/state.bin", Body=payload)

    def save() -> None:
        nonlocal step
        step += 1
        accel.save_checkpoint(ctx, "s3://bench/run", state, step=step, keep=1)

    def background() -> tuple[float, float]:
        nonlocal step
        step += 1
        start = time.perf_counter()
        handle = accel.save_checkpoint(ctx, "s3://bench/run", state, step=step, keep=1,
                                       blocking=False)  # fmt: skip
        held = time.perf_counter() - start
        handle.wait()
        return held, time.perf_counter() - start

    def parts(n: int) -> Callable[[], None]:
        return lambda: transfer.upload("bench", remote.child(f"p{n}"), files, parallel=n)

    put()  # warm the client and the server once
    save()
    groups: dict[str, Callable[[], object]] = {
        "by hand: one put_object": put,
        "accel save_checkpoint (blocking)": save,
        **{f"accel upload, {n} in flight": parts(n) for n in (1, 2, 4, 8)},
    }
    times: dict[str, list[float]] = {name: [] for name in groups}
    held: list[float] = []
    durable: list[float] = []
    names = list(groups)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_timed(groups[name]))
        h, d = background()
        held.append(h)
        durable.append(d)
    _report(times, held, durable, mb)
    _cpu_of("one put_object", put, server_pid, mb)
    _cpu_of("one accel save", save, server_pid, mb)
    _profile(save)


def endpoint_of() -> str:
    return os.environ["AWS_ENDPOINT_URL"]


def _report(times: dict[str, list[float]], held: list[float], durable: list[float], mb: float
            ) -> None:  # fmt: skip
    hand = min(times["by hand: one put_object"])
    hand_median = statistics.median(times["by hand: one put_object"])
    print("\n| operation | best s | MB/s | vs one put (best) | median s | vs one put (median) |")
    print("|---|---|---|---|---|---|")
    for name, runs in times.items():
        best, median = min(runs), statistics.median(runs)
        ratio = "" if name.startswith("by hand") else f"{hand / best:.2f}x"
        ratio_median = "" if name.startswith("by hand") else f"{hand_median / median:.2f}x"
        print(f"| {name} | {best:.2f} | {mb / best:.0f} | {ratio} | {median:.2f} | "
              f"{ratio_median} |")  # fmt: skip
    blocking = times["accel save_checkpoint (blocking)"]
    print(f"| accel blocking=False, time held | {min(held):.3f} | | "
          f"{min(held) / min(blocking):.1%} of a blocking save | {statistics.median(held):.3f} | "
          f"{statistics.median(held) / statistics.median(blocking):.1%} |")  # fmt: skip
    print(f"| accel blocking=False, until committed | {min(durable):.2f} | {mb / min(durable):.0f}"
          f" | | {statistics.median(durable):.2f} | |")  # fmt: skip
    print("\nevery round, seconds:")
    for name, runs in [*times.items(), ("blocking=False held", held),
                       ("blocking=False committed", durable)]:  # fmt: skip
        print(f"  {name}: {' '.join(f'{t:.2f}' for t in runs)}")


def _cpu_of(name: str, fn: Callable[[], None], server_pid: int, mb: float) -> None:
    """Where one call's time goes between the two processes: CPU seconds of each."""
    client, server = _cpu_seconds(os.getpid()), _cpu_seconds(server_pid)
    wall = _timed(fn)
    client, server = _cpu_seconds(os.getpid()) - client, _cpu_seconds(server_pid) - server
    print(f"\n{name}: {wall:.2f} s wall; CPU: client {client:.2f} s, server {server:.2f} s "
          f"({(client + server) / wall:.2f} cores busy of {os.cpu_count()}; the server spends "
          f"{server / mb * 1000:.1f} ms of CPU per MB)")  # fmt: skip


def _profile(save: Callable[[], None]) -> None:
    """The cumulative time of the phases of one accel save, in the caller's thread."""
    profile = cProfile.Profile()
    profile.enable()
    save()
    profile.disable()
    print("\nphases of one accel save (cProfile):")
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("cumulative")
    phases = ("snapshot", "write_files", "upload", "check_object", "commit", "_dcp_and_snapshot",
              "finish_rank", "announce", "check_target", "sweep_steps", "rotate")  # fmt: skip
    stats.print_stats("|".join(f"\\b{p}\\b" for p in phases))
    for line in out.getvalue().splitlines():
        if any(f"({p})" in line for p in phases):
            cum = float(line.split()[3])
            print(f"  {line.rsplit('(', 1)[1].rstrip(')'):>20}: {cum:.2f} s cumulative "
                  "(the caller's thread)")  # fmt: skip


if __name__ == "__main__":
    main()
