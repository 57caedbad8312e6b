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

A GPT-2-sized case (124M parameters, tied embedding and head, 12 blocks in an `nn.ModuleList`,
saved by `accel.save_model` in shards of 100 MB) is loaded by hand, by accel with a CPU map and
with a CPU budget of 250 MB (the rest read in place from the shards), and by Accelerate with the
same maps when it is installed: load + first forward, steady forward, and the peak memory of
each load in a fresh process.

    python benchmarks/big_model.py            # both cases
    python benchmarks/big_model.py --case linear --quick   # 8 x Linear(1024, 1024), 34 MB
    python benchmarks/big_model.py --case gpt2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import accel

# The GPT-2-shaped model is the one the tests load; the repository root holds `tests/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import GPT2_124M, GPT2LMHead


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


def linear_case(quick: bool) -> None:
    layers, width, repeats = (8, 1024, 5) if quick else (16, 2048, 11)
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


# ---- GPT-2 sized: 124M parameters, shards of 100 MB, a CPU budget of 250 MB -----------------

GPT2_BUDGET = {"cpu": "250MB"}
IDS = torch.arange(64).view(1, 64)


def gpt2_by_hand(folder: Path) -> nn.Module:
    with torch.device("meta"):
        model = GPT2LMHead(GPT2_124M)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    tied = state.get("lm_head.weight", state.get("transformer.wte.weight"))
    state["lm_head.weight"] = state["transformer.wte.weight"] = tied  # stored once
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.transformer.wte.weight
    model(IDS)
    return model


def gpt2_accel(folder: Path, budget: bool) -> nn.Module:
    with accel.init_empty_weights():
        model = GPT2LMHead(GPT2_124M)
    if budget:
        model = accel.dispatch_checkpoint(model, folder, max_memory=GPT2_BUDGET)
    else:
        model = accel.dispatch_checkpoint(model, folder, device_map={"": "cpu"})
    model(IDS)
    return model


def gpt2_accelerate(folder: Path, budget: bool) -> nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = GPT2LMHead(GPT2_124M)
    if budget:
        model = load_checkpoint_and_dispatch(
            model, str(folder), device_map="auto", max_memory=dict(GPT2_BUDGET),
            offload_folder=str(folder / "offload"),
        )  # fmt: skip
    else:
        model = load_checkpoint_and_dispatch(model, str(folder), device_map={"": "cpu"})
    model(IDS)
    return model


GPT2_VARIANTS: dict[str, Callable[[Path], nn.Module]] = {
    "by hand (meta + load_file + assign)": gpt2_by_hand,
    "accel, CPU map": lambda f: gpt2_accel(f, budget=False),
    "accel, CPU budget 250 MB": lambda f: gpt2_accel(f, budget=True),
    "Accelerate, CPU map": lambda f: gpt2_accelerate(f, budget=False),
    "Accelerate, CPU budget 250 MB": lambda f: gpt2_accelerate(f, budget=True),
}


def peak_mib(name: str, folder: Path) -> float:
    """Peak RSS (VmHWM) of one load + first forward in a fresh process, above its start."""
    run = subprocess.run(
        [sys.executable, __file__, "--peak", name, str(folder)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(run.stdout.split()[-1])


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def measure_peak(name: str, folder: Path) -> None:
    torch.set_num_threads(1)
    start = _vm("VmRSS")
    with torch.no_grad():
        GPT2_VARIANTS[name](folder)
    print((_vm("VmHWM") - start) / 1024)


def gpt2_case(repeats: int) -> None:
    torch.set_num_threads(1)
    names = list(GPT2_VARIANTS)
    if importlib.util.find_spec("accelerate") is None:
        names = [n for n in names if not n.startswith("Accelerate")]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        folder = Path(tmp)
        torch.manual_seed(0)
        accel.save_model(accel.RunContext.single(), GPT2LMHead(GPT2_124M), folder,
                         max_shard_size="100MB")  # fmt: skip
        for name in names:
            GPT2_VARIANTS[name](folder)  # warm the page cache and the allocator
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                times[name].append(seconds(lambda n=name: GPT2_VARIANTS[n](folder)))
        peaks = {name: peak_mib(name, folder) for name in names}
        budgeted = gpt2_accel(folder, budget=True)
        shards = len(list(folder.glob("*.safetensors")))
        print(
            f"\nGPT-2 shaped, 124M parameters, {shards} shards of <= 100 MB, one thread, ids 1 x 64"
        )
        print(f"accel's map under {GPT2_BUDGET}: {budgeted.hf_device_map}")
        print(f"median of {repeats} interleaved loads; peak RSS of one load in a fresh process")
        print("\n| load + first forward | best ms | median ms | ratio to by hand | peak MiB |")
        print("|---|---|---|---|---|")
        base = statistics.median(times[names[0]])
        for name, ts in times.items():
            ms = statistics.median(ts)
            print(f"| {name} | {min(ts) * 1e3:.0f} | {ms * 1e3:.0f} | {ms / base:.2f} | "
                  f"{peaks[name]:.0f} |")  # fmt: skip
        full = gpt2_by_hand(folder)
        steady: dict[str, list[float]] = {"fully loaded": [], "accel, CPU budget 250 MB": []}
        for _ in range(repeats * 2):
            steady["fully loaded"].append(seconds(lambda: full(IDS)))
            steady["accel, CPU budget 250 MB"].append(seconds(lambda: budgeted(IDS)))
        assert torch.equal(full(IDS), budgeted(IDS))
        print(
            "\n| steady forward | best ms | median ms | ratio to fully loaded |\n|---|---|---|---|"
        )
        base = statistics.median(steady["fully loaded"])
        for name, ts in steady.items():
            ms = statistics.median(ts)
            print(f"| {name} | {min(ts) * 1e3:.1f} | {ms * 1e3:.1f} | {ms / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", choices=("linear", "gpt2", "all"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peak", nargs=2, metavar=("VARIANT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        measure_peak(args.peak[0], Path(args.peak[1]))
    else:
        if args.case in ("linear", "all"):
            linear_case(args.quick)
        if args.case in ("gpt2", "all"):
            gpt2_case(3 if args.quick else 7)


if __name__ == "__main__":
    main()
