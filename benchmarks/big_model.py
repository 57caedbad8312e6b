"""Loading big models: dispatch_checkpoint against meta-init + safetensors by hand (one process).

A stack of Linear layers is saved as a sharded safetensors checkpoint (3 shards + index), then
loaded repeatedly, the variants interleaved so drift in the machine hits all alike (the shards
stay in the page cache, as they would on a second load):

- by hand: build under `torch.device("meta")`, `load_file` each shard,
  `load_state_dict(assign=True)`, first forward;
- accel, CPU map: `init_empty_weights` + `dispatch_checkpoint(device_map={"": "cpu"})`;
- accel, half on disk: the second half of the layers mapped to "disk" (read in place from the
  shards through memory maps), load + first forward, then the steady forward against the fully
  loaded model;
- Accelerate's `load_checkpoint_and_dispatch`, when it is installed.

    python benchmarks/big_model.py            # 16 x Linear(2048, 2048), 268 MB
    python benchmarks/big_model.py --quick    # 8 x Linear(1024, 1024), 34 MB
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import accel


def build(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def save_sharded(model: nn.Module, folder: Path, shards: int = 3) -> None:
    state = model.state_dict()
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        keys = names[i * per : (i + 1) * per]
        save_file({k: state[k] for k in keys}, folder / f"part{i}.safetensors")
        weight_map.update({k: f"part{i}.safetensors" for k in keys})
    index = json.dumps({"weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(index)


def by_hand(folder: Path, layers: int, width: int, x: torch.Tensor) -> nn.Module:
    with torch.device("meta"):
        model = build(layers, width)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("part*.safetensors")):
        state.update(load_file(shard))
    model.load_state_dict(state, assign=True)
    model(x)
    return model


def with_accel(
    folder: Path, layers: int, width: int, x: torch.Tensor, device_map: dict[str, int | str]
) -> nn.Module:
    with accel.init_empty_weights():
        model = build(layers, width)
    model = accel.dispatch_checkpoint(model, folder, device_map=device_map)
    model(x)
    return model


def with_accelerate(folder: Path, layers: int, width: int, x: torch.Tensor) -> nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = build(layers, width)
    model = load_checkpoint_and_dispatch(model, str(folder), device_map={"": "cpu"})
    model(x)
    return model


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    layers, width, repeats = (8, 1024, 5) if args.quick else (16, 2048, 11)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8, width)
    half = {**{str(i): "cpu" for i in range(layers // 2)}}
    half.update({str(i): "disk" for i in range(layers // 2, layers)})
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        folder = Path(tmp)
        save_sharded(build(layers, width), folder)
        variants: dict[str, Callable[[], object]] = {
            "by hand (meta + load_file + assign)": lambda: by_hand(folder, layers, width, x),
            "accel, CPU map": lambda: with_accel(folder, layers, width, x, {"": "cpu"}),
            "accel, half on disk": lambda: with_accel(folder, layers, width, x, half),
        }
        if importlib.util.find_spec("accelerate") is not None:
            variants["Accelerate, CPU map"] = lambda: with_accelerate(folder, layers, width, x)
        for fn in variants.values():
            fn()  # warm the page cache and the allocator
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                times[name].append(seconds(fn))
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6
        print(f"torch {torch.__version__}, {layers} x Linear({width}, {width}), {size:.0f} MB")
        print(f"in 3 shards, batch 8, one thread, median of {repeats} interleaved loads")
        print("\n| load + first forward | median ms | ratio to by hand |\n|---|---|---|")
        base = statistics.median(times["by hand (meta + load_file + assign)"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            print(f"| {name} | {ms * 1e3:.1f} | {ms / base:.3f} |")

        full = by_hand(folder, layers, width, x)
        offloaded = with_accel(folder, layers, width, x, half)
        steady: dict[str, list[float]] = {"fully loaded": [], "accel, half on disk": []}
        for _ in range(repeats * 4):
            steady["fully loaded"].append(seconds(lambda: full(x)))
            steady["accel, half on disk"].append(seconds(lambda: offloaded(x)))
        assert torch.equal(full(x), offloaded(x))
        print("\n| steady forward | median ms | ratio to fully loaded |\n|---|---|---|")
        base = statistics.median(steady["fully loaded"])
        for name, ts in steady.items():
            ms = statistics.median(ts)
            print(f"| {name} | {ms * 1e3:.2f} | {ms / base:.3f} |")


if __name__ == "__main__":
    main()
