"""Sharded I/O: loading a Hugging Face checkpoint into an FSDP2 model, and saving it back.

A ~512 MB fp32 model (32 Linear(2048, 2048) layers, no bias, each its own FSDP2 unit) saved by
`save_model` as 100 MB shards with an index and a manifest. At 2 and 4 ranks (gloo, CPU), each
round starts fresh processes for every method (so peak memory is the method's own), in an
order rotated every round:

- accel: `load_checkpoint_in_model(model, dir)`: every rank reads only its slices, verifies
  the manifest's checksums split across ranks;
- accel, no manifest: the same files without accel's manifest (as a Hugging Face Hub download
  comes): nothing to verify, so the slices are all that is read;
- dcp-hf: torch's `dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(dir))`;
- full-then-shard: every rank reads the whole checkpoint (`safetensors.torch.load_file`) and
  `set_model_state_dict(..., full_state_dict=True)` takes its slices (what accel did before);
- accelerate: Accelerate's FSDP2 loading (`fsdp2_load_full_state_dict`, its
  `cpu_ram_efficient_loading` path: rank 0 reads the whole checkpoint and broadcasts each
  tensor), measured when `accelerate` is importable (it is not a dependency of accel; put an
  install on PYTHONPATH, e.g. `pip install --target /tmp/accsite --no-deps accelerate
  huggingface_hub psutil`).

Saving: accel's sharded `save_model` (every rank writes its slices, nothing gathered) against
`save_model(..., full_state_dict=True)` (gathered, rank 0 writes), and against `save_model` of
the same model unsharded in one process (the reference the files are byte-identical to).

Time is the slowest rank's time for the call (the model is built on meta and allocated before
the clock starts); memory is each rank's resident-set growth at its peak during the call
(VmHWM after resetting it), the largest over ranks. Best and median over rounds are printed.
`--dir /dev/shm` puts the checkpoint and the saves on tmpfs, which measures the code and not
the disk (fsync is then free); the default directory measures both.

    python benchmarks/sharded_io.py              # 512 MB, 3 rounds
    python benchmarks/sharded_io.py --quick      # 32 MB, 2 rounds
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accel
from accel import RunContext
from accel.testing import run_world


class Stack(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))


def _rss(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if key in x)
    return int(line.split()[1]) * 1024


def _measure(call: Callable[[], Any]) -> tuple[float, int]:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _rss("VmRSS")
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, _rss("VmHWM") - before


def _sharded(width: int, layers: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with accel.init_empty_weights():
        model = Stack(width, layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(1)  # touch this rank's pages before measuring
    return model


def _accelerate_load(ctx: RunContext, checkpoint: str, width: int, layers: int) -> nn.Module:
    """Accelerate's FSDP2 loading (`cpu_ram_efficient_loading`): the model is sharded on meta,
    rank 0 reads the whole checkpoint, and `fsdp2_load_full_state_dict` broadcasts each tensor
    and keeps each rank's slice. It reads only `is_main_process` from its `accelerator`."""
    from types import SimpleNamespace

    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    with accel.init_empty_weights():
        model = Stack(width, layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.distributed.barrier()

    def load() -> None:
        full: dict[str, torch.Tensor] = {}
        if ctx.is_main:
            for f in sorted(Path(checkpoint).glob("*.safetensors")):
                full.update(load_file(f))
        accelerator = SimpleNamespace(is_main_process=ctx.is_main)
        fsdp2_load_full_state_dict(accelerator, model, full)

    result = _measure(load)
    return model, result


def _load(ctx: RunContext, checkpoint: str, method: str, width: int, layers: int) -> Any:
    if method == "accelerate":
        model, result = _accelerate_load(ctx, checkpoint, width, layers)
        check = model.layers[-1].weight.full_tensor()[-1, -1].item()
        torch.distributed.barrier()
        return (*result, check)
    model = _sharded(width, layers)
    torch.distributed.barrier()
    if method == "accel":
        result = _measure(lambda: accel.load_checkpoint_in_model(model, checkpoint))
    elif method == "accel, no manifest":
        plain = f"{checkpoint}-plain"  # the same files without accel's manifest (a Hub download)
        result = _measure(lambda: accel.load_checkpoint_in_model(model, plain))
    elif method == "dcp-hf":
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()
        reader = dcp.HuggingFaceStorageReader(checkpoint)
        result = _measure(lambda: dcp.load(state, storage_reader=reader))
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        def full_then_shard() -> None:
            full: dict[str, torch.Tensor] = {}
            for f in sorted(Path(checkpoint).glob("*.safetensors")):
                full.update(load_file(f))
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, full, options=options)  # type: ignore[arg-type]

        result = _measure(full_then_shard)
    check = model.layers[-1].weight.full_tensor()[-1, -1].item()
    torch.distributed.barrier()
    return (*result, check)


def _save(ctx: RunContext, out: str, method: str, width: int, layers: int) -> Any:
    if method == "unsharded":
        with accel.init_empty_weights():
            model = Stack(width, layers)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        return _measure(lambda: accel.save_model(ctx, model, out, max_shard_size="100MB"))
    model = _sharded(width, layers)
    full = method == "gathered"
    torch.distributed.barrier()
    return _measure(
        lambda: accel.save_model(ctx, model, out, max_shard_size="100MB", full_state_dict=full)
    )


def _rotated(methods: list[str], r: int) -> list[str]:
    return methods[r % len(methods) :] + methods[: r % len(methods)]


def _summary(name: str, rounds: list[tuple[float, int]]) -> str:
    times, peaks = [r[0] for r in rounds], [r[1] / 2**20 for r in rounds]
    return (
        f"| {name} | {min(times):.3f} | {statistics.median(times):.3f} | "
        f"{min(peaks):.0f} | {statistics.median(peaks):.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument(
        "--dir", default=None, help="where the checkpoint and the saves go (default: $TMPDIR)"
    )
    args = parser.parse_args()
    width, layers = (512, 32) if args.quick else (2048, 32)
    rounds = args.rounds or (2 if args.quick else 3)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="accel-bench-sharded-", dir=args.dir) as tmp:
        checkpoint = f"{tmp}/hf"
        with accel.init_empty_weights():
            source = Stack(width, layers)
        source.to_empty(device="cpu")
        with torch.no_grad():
            for p in source.parameters():
                p.normal_()
        accel.save_model(RunContext.single(), source, checkpoint, max_shard_size="100MB")
        expected = source.layers[-1].weight[-1, -1].item()
        Path(f"{checkpoint}-plain").mkdir()
        for f in Path(checkpoint).iterdir():
            if f.name != "accel-manifest.json":
                os.link(f, f"{checkpoint}-plain/{f.name}")
        size_mb = sum(p.numel() * 4 for p in source.parameters()) / 2**20
        largest = width * width * 4 / 2**20
        del source
        print(f"model: {size_mb:.0f} MiB in {len(list(Path(checkpoint).glob('*.sa*')))} files; "
              f"largest tensor {largest:.0f} MiB; {rounds} rounds\n")  # fmt: skip
        load_methods = ["accel", "accel, no manifest", "dcp-hf", "full-then-shard"]
        if importlib.util.find_spec("accelerate") is None:
            print("accelerate is not installed: its FSDP2 loading is not measured.\n")
        else:
            import accelerate

            print(f"accelerate {accelerate.__version__}: its FSDP2 loading is measured.\n")
            load_methods.append("accelerate")
        for world_size in [int(w) for w in args.world_sizes.split(",")]:
            save_methods = ["sharded", "gathered", "unsharded"]
            results: dict[str, list[tuple[float, int]]] = {m: [] for m in load_methods}
            results.update({f"save {m}": [] for m in save_methods})
            for r in range(rounds):
                for method in _rotated(load_methods, r):
                    out = run_world(_load, world_size=world_size, timeout=600,
                                    args=(checkpoint, method, width, layers))  # fmt: skip
                    assert all(abs(o[2] - expected) < 1e-6 for o in out), (method, out)
                    results[method].append((max(o[0] for o in out), max(o[1] for o in out)))
                for method in _rotated(save_methods, r):
                    n = 1 if method == "unsharded" else world_size
                    target = f"{tmp}/save-{method}"
                    out = run_world(_save, world_size=n, timeout=600,
                                    args=(target, method, width, layers))  # fmt: skip
                    results[f"save {method}"].append(
                        (max(o[0] for o in out), max(o[1] for o in out))
                    )
            print(f"## {world_size} ranks (1/N of the model: {size_mb / world_size:.0f} MiB, "
                  f"largest slice {largest / world_size:.0f} MiB)\n")  # fmt: skip
            print("| method | best s | median s | best peak MiB/rank | median peak MiB/rank |")
            print("|---|---|---|---|---|")
            for name, rows in results.items():
                print(_summary(name, rows))
            print()


if __name__ == "__main__":
    main()
