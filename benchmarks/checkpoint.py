"""Checkpoint throughput: accel's save_state / load_state / save_model against plain safetensors.

A ~500 MB fp32 model (8 Linear(4096, 4096) layers) with its AdamW state (twice that again) on
CPU, one process. Each round runs, interleaved:

- the disk's own bandwidth: the same number of bytes written with os.write, then fsync;
- by hand: `safetensors.torch.save_file` of the model tensors and of the optimizer's tensors,
  then fsync of both files (the time until durable), and `load_file` of both into the model
  and optimizer (`load_state_dict`);
- accel: `save_state(ctx, d, model=..., optimizer=...)` (returns once durable: fsync, manifest,
  rename), `load_state` (verifies every checksum), `save_model` (durable on return);
- `save_checkpoint(..., blocking=False)`: the time training is held (the call's return),
  against a plain host-memory copy of the same tensors, and the time until durable (`wait()`).

Throughput ratio = by-hand time / accel time (>= 1 means accel is at least as fast).

    python benchmarks/checkpoint.py            # ~500 MB model + ~1 GB AdamW state
    python benchmarks/checkpoint.py --quick    # ~16 MB model, a few seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import accel


def _setup(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # creates exp_avg and exp_avg_sq
    return model, opt


def _opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


def _hand_load(model: nn.Module, opt: torch.optim.Optimizer, d: Path) -> None:
    """load_file, then copy into the model and the optimizer state (what load_state does)."""
    model.load_state_dict(load_file(d / "m.safetensors"))
    loaded = load_file(d / "o.safetensors")  # mmap: copy, or the data is never read
    state = opt.state_dict()
    for i, s in state["state"].items():
        for k in s:
            s[k] = loaded[f"{i}.{k}"].clone()
    opt.load_state_dict(state)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    width, layers = (1024, 4) if args.quick else (4096, 8)
    rounds = args.rounds or (3 if args.quick else 5)
    ctx = accel.RunContext.single()
    model, opt = _setup(width, layers)
    msd = {k: v.contiguous() for k, v in model.state_dict().items()}
    osd = _opt_tensors(opt)
    total = sum(t.numel() * t.element_size() for t in [*msd.values(), *osd.values()])
    model_bytes = sum(t.numel() * t.element_size() for t in msd.values())
    raw = os.urandom(1 << 20) * (total >> 20)
    root = Path(tempfile.mkdtemp(prefix="accel-bench-", dir=args.dir))
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for r in range(rounds):
        d = root / f"r{r}"
        d.mkdir()
        _one_round(ctx, model, opt, raw, d, r, record)
        shutil.rmtree(d)
    shutil.rmtree(root)
    _report(times, total, model_bytes, rounds, width, layers)


def _one_round(
    ctx: accel.RunContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    raw: bytes,
    d: Path,
    r: int,
    record: Callable[[str, float], None],
) -> None:
    msd = {k: v.contiguous() for k, v in model.state_dict().items()}
    osd = _opt_tensors(opt)
    # The disk's own write+fsync bandwidth, for the same byte count.
    start = time.perf_counter()
    with open(d / "raw.bin", "wb", buffering=0) as f:
        view = memoryview(raw)
        for i in range(0, len(view), 64 << 20):
            f.write(view[i : i + (64 << 20)])
        os.fsync(f.fileno())
    record("disk write+fsync", time.perf_counter() - start)
    (d / "raw.bin").unlink()

    def by_hand() -> None:
        start = time.perf_counter()
        save_file(msd, d / "m.safetensors")
        save_file(osd, d / "o.safetensors")
        record("hand save (return)", time.perf_counter() - start)
        _fsync(d / "m.safetensors")
        _fsync(d / "o.safetensors")
        record("hand save (durable)", time.perf_counter() - start)
        record("hand load", _timed(lambda: _hand_load(model, opt, d)))
        start = time.perf_counter()
        save_file(msd, d / "m2.safetensors")
        _fsync(d / "m2.safetensors")
        record("hand save model (durable)", time.perf_counter() - start)

    def with_accel() -> None:
        # save_state and save_model return once durable; load_state verifies every checksum.
        state_dir = d / "state"
        objects = {"model": model, "optimizer": opt}
        record("accel save_state", _timed(lambda: accel.save_state(ctx, state_dir, **objects)))
        record("accel load_state", _timed(lambda: accel.load_state(ctx, state_dir, **objects)))
        record("accel save_model", _timed(lambda: accel.save_model(ctx, model, d / "hf")))

    # Alternate which goes first, so page-cache and writeback state favours neither.
    for run in (by_hand, with_accel) if r % 2 == 0 else (with_accel, by_hand):
        run()
    # Background save: the time training is held, against a plain host copy of the tensors.
    everything = [*msd.values(), *osd.values()]
    record("host copy of state", _timed(lambda: [t.clone() for t in everything]))
    state = {"model": model, "optimizer": opt}
    start = time.perf_counter()
    handle = accel.save_checkpoint(ctx, d / "ckpt", state, step=r, blocking=False)
    record("accel blocking=False (held)", time.perf_counter() - start)
    handle.wait()
    record("accel blocking=False (durable)", time.perf_counter() - start)


def _report(times: dict[str, list[float]], total: int, model_bytes: int, rounds: int,
            width: int, layers: int) -> None:  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = total / 1e6
    print(f"model {model_bytes / 1e6:.0f} MB + AdamW state = {mb:.0f} MB; "
          f"{layers} x Linear({width}, {width}); median of {rounds} rounds\n")  # fmt: skip
    print("| operation | seconds | MB/s | vs by hand |")
    print("|---|---|---|---|")
    rows = [
        ("disk write+fsync", mb, None),
        ("hand save (return)", mb, None),
        ("hand save (durable)", mb, None),
        ("accel save_state", mb, "hand save (durable)"),
        ("hand load", mb, None),
        ("accel load_state", mb, "hand load"),
        ("hand save model (durable)", model_bytes / 1e6, None),
        ("accel save_model", model_bytes / 1e6, "hand save model (durable)"),
        ("host copy of state", mb, None),
        ("accel blocking=False (held)", mb, "host copy of state"),
        ("accel blocking=False (durable)", mb, "hand save (durable)"),
    ]
    for name, size, ref in rows:
        ratio = f"{med[ref] / med[name]:.2f}x" if ref else ""
        print(f"| {name} | {med[name]:.3f} | {size / med[name]:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
