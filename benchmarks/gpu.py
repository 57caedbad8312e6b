"""One GPU: a ~1B Llama-style training step by hand, with accel and with Accelerate; GPT-2 loads.

The step (bf16 autocast over fp32 weights, AdamW, sequence 2048) runs written by hand with
torch.autocast, through accel's calls, and through Accelerate's `Accelerator` (when installed),
eager (and, with --compile, compiled too). The loops share one set of weights and one optimizer
(the values do not matter to the timing, and six copies of a 1B model would not fit), and run
interleaved in rounds, the order rotating, so drift hits all alike. Reported per variant:
median seconds per step, tokens/s, model FLOPs utilisation against the card's dense bf16 peak
(6 x parameters outside the embedding + 12 x layers x dim x seq per token, no causal discount),
and peak GPU memory. Then a GPT-2-124M-shaped checkpoint is loaded onto the GPU (and split over
GPU, CPU and disk) by `accel.dispatch_checkpoint` and Accelerate's `load_checkpoint_and_dispatch`,
interleaved, with a first forward each, outputs compared. Last, where torchao can be imported,
fp8 at two widths (4 layers of dim 2048, the step's matmul shapes; 2 layers of dim 4096, 32
heads, Llama-3-8B's): accel's step compiled in bf16 and in fp8 (`precision="fp8"`, torchao's
tensorwise float8 Linear layers), and at dim 4096 torchao wired by hand (convert_to_float8_training,
torch.compile, torch.autocast), interleaved; without torchao the section says it was skipped.

`--only step|load|fp8` runs one section (`make gpu-check` runs each as its own part, under its
own time limit). Results go to --out as JSON, rewritten after every measurement, so a run
stopped by its time limit keeps what it measured. `--dry-run` runs the same code on the CPU at
tiny sizes (compile through the aot_eager backend), as CI does through `make gpu-check DRY_RUN=1`.

    python benchmarks/gpu.py --out gpu-benchmark.json
    python benchmarks/gpu.py --only fp8 --fp8-dims 4096 --out fp8.json
    python benchmarks/gpu.py --dry-run --out /tmp/gpu-benchmark.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.gpu.plumbing

import accel
from tests.gpu import plumbing
from tests.models import lm_loss

FULL = plumbing.LlamaSizes(vocab=32000, dim=2048, heads=16, layers=16, seq=2048, batch=4)
TINY = plumbing.LlamaSizes(vocab=64, dim=32, heads=4, layers=2, seq=32, batch=2)
# fp8 at two widths: the step's matmul shapes in 4 layers, and Llama-3-8B's (dim 4096) in 2.
FP8 = {
    2048: dataclasses.replace(FULL, layers=4),
    4096: plumbing.LlamaSizes(vocab=32000, dim=4096, heads=32, layers=2, seq=2048, batch=4),
}
FP8_TINY = {2048: TINY, 4096: dataclasses.replace(TINY, dim=64, layers=1)}

# The defaults fit `make gpu-check`'s 6 minutes (tools/gpu_check.py). The first run (one H200,
# 2026-11-27, torch 2.11) had 4 rounds of 3 steps after 3 warm-up steps, the step eager and
# compiled in all three loops, fp8 eager and compiled: the step and the loads alone took 150 s
# (three inductor compiles of the 16-layer model were most of it; a step is 0.13 s eager, 0.12 s
# compiled) and the whole benchmark about 8 minutes. Now: the step eager only (3 loops of 8
# steps, about 3 s of steps; --compile adds the compiled loops, 1.011x of hand on that run),
# 3 GPT-2 loads a map (5 before; a round of the four loads took about 2.1 s), fp8 compiled only
# (eager fp8 was 0.29x of bf16: it measures nothing a user runs), 3 rounds of 2 steps after 2
# warm-up steps. Not yet timed on a GPU at these defaults: the compiles dominate the fp8 parts.
ROUNDS, STEPS, WARMUP, LOAD_REPEATS = 3, 2, 2, 3
SECTIONS = ("step", "load", "fp8")

# Dense bf16 tensor-core peaks (no sparsity), by the device name torch reports.
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
             ("GH200", 989e12), ("A100", 312e12))  # fmt: skip


def peak_flops(name: str) -> float | None:
    """The card's dense bf16 peak, matched on the device name; None for an unknown card."""
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def flops_per_token(model: nn.Module, sizes: plumbing.LlamaSizes) -> float:
    dense = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    return 6 * dense + 12 * sizes.layers * sizes.dim * sizes.seq


class Shared(nn.Module):
    """A fresh module around the shared one: Accelerate patches the forward of what it prepares."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)


def step_by_hand(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> Any:
    def step(tokens: torch.Tensor, _: int) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def step_with_accel(ctx: accel.RunContext, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    scaler = accel.make_scaler(ctx)

    def step(tokens: torch.Tensor, i: int) -> None:
        with accel.accumulate(ctx, model, step=i) as sync, accel.autocast(ctx):
            loss = lm_loss(model, tokens)
        accel.scaled_backward(ctx, loss, scaler=scaler)
        if sync:
            accel.optimizer_step(ctx, opt, scaler=scaler)
            opt.zero_grad()

    return step


def step_with_accelerate(base: nn.Module, opt: torch.optim.Optimizer, compiled: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # the dynamo setting is process-wide state in Accelerate
    accelerator = Accelerator(
        mixed_precision="bf16", dynamo_backend="inductor" if compiled else "no"
    )
    model, aopt = accelerator.prepare(Shared(base), opt)

    def step(tokens: torch.Tensor, _: int) -> None:
        loss = lm_loss(model, tokens)  # Accelerate's forward runs under autocast
        accelerator.backward(loss)
        aopt.step()
        aopt.zero_grad()

    return step


def build_steps(
    device: torch.device, sizes: plumbing.LlamaSizes, accelerate: bool, modes: tuple[bool, ...]
) -> tuple[dict[str, Any], nn.Module]:
    with torch.device(device):  # built in place: a 1.2B model initialised on the CPU takes long
        base = plumbing.make_llama(sizes)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=plumbing.on_gpu(device))
    ctx = accel.RunContext.single(device=device, precision="bf16")
    steps: dict[str, Any] = {}
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        hand = torch.compile(base) if compiled else base
        steps[f"hand, {mode}"] = step_by_hand(hand, opt, device)
        steps[f"accel, {mode}"] = step_with_accel(
            ctx, accel.wrap_model(ctx, base, compile=compiled), opt
        )
        if accelerate:
            steps[f"Accelerate, {mode}"] = step_with_accelerate(base, opt, compiled)
    return steps, base


def sync(device: torch.device) -> None:
    if plumbing.on_gpu(device):
        torch.cuda.synchronize(device)


def interleave(
    args: argparse.Namespace, device: torch.device, steps: dict[str, Any], tokens: torch.Tensor,
    done_round: Callable[[dict[str, list[float]], dict[str, int]], None],
) -> None:  # fmt: skip
    """Warm each step up, then time args.steps steps of each a round, the order rotating."""
    names = list(steps)
    for name in names:  # warm up: compile, allocator, cuBLAS plans
        for i in range(args.warmup):
            steps[name](tokens, i)
        sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = dict.fromkeys(names, 0)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if plumbing.on_gpu(device):
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            for i in range(args.steps):
                steps[name](tokens, i)
            sync(device)
            times[name].append((time.perf_counter() - start) / args.steps)
            if plumbing.on_gpu(device):
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
        done_round(times, peaks)


def time_steps(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    sizes = TINY if args.dry_run else FULL
    accelerate = importlib.util.find_spec("accelerate") is not None
    modes = (False, True) if args.compile else (False,)
    report["step"] = step_report = {
        "sizes": vars(sizes), "rounds": args.rounds, "steps_per_round": args.steps,
        "warmup": args.warmup, "compiled": args.compile,
        "accelerate": "measured" if accelerate else "skipped: accelerate is not installed",
        "variants": {},
    }  # fmt: skip
    steps, base = build_steps(device, sizes, accelerate, modes)
    step_report["parameters"] = sum(p.numel() for p in base.parameters())
    per_token = flops_per_token(base, sizes)
    step_report["flops_per_token"] = per_token
    peak = peak_flops(report["device"]) if plumbing.on_gpu(device) else None
    step_report["peak_bf16_flops"] = peak
    tokens = plumbing.tokens(sizes, steps=1)[0].to(device)

    def done_round(times: dict[str, list[float]], peaks: dict[str, int]) -> None:
        step_report["variants"] = summarize(times, peaks, sizes, per_token, peak)
        write(args.out, report)

    interleave(args, device, steps, tokens, done_round)


def summarize(
    times: dict[str, list[float]], peaks: dict[str, int], sizes: plumbing.LlamaSizes,
    per_token: float, peak: float | None,
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    for name, ts in times.items():
        step = statistics.median(ts)
        tokens_s = sizes.batch * sizes.seq / step
        mode = name.split(", ")[1]
        out[name] = {
            "median_step_s": step, "best_step_s": min(ts), "tokens_per_s": tokens_s,
            "mfu": tokens_s * per_token / peak if peak else None,
            "peak_memory_gib": peaks[name] / 2**30 if peaks[name] else None,
            "ratio_to_hand": step / statistics.median(times[f"hand, {mode}"]),
        }  # fmt: skip
    return out


# ---- GPT-2 loads -------------------------------------------------------------------------


def load_accel(folder: Path, shape: Any, device_map: dict[str, Any], _: Path) -> nn.Module:
    with accel.init_empty_weights():
        model = plumbing.make_gpt2(shape)
    return accel.dispatch_checkpoint(model, folder, device_map=device_map)


def load_accelerate(folder: Path, shape: Any, device_map: dict[str, Any], tmp: Path) -> nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = plumbing.make_gpt2(shape)
    # Accelerate's init_empty_weights turns the tie made in __init__ into two meta tensors;
    # tie again, as transformers' tie_weights() does for its own models after building them.
    model.lm_head.weight = model.transformer.wte.weight
    return load_checkpoint_and_dispatch(  # type: ignore[no-any-return]
        model, str(folder), device_map=device_map, offload_folder=str(tmp / "offload")
    )


def time_loads(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    shape = plumbing.gpt2_shape(device)
    accelerate = importlib.util.find_spec("accelerate") is not None
    maps = {"all on the GPU": {"": plumbing.gpu_key(device)},
            "GPU, CPU and disk": plumbing.split_map(device, shape.layers)}  # fmt: skip
    loaders: dict[str, Callable[..., nn.Module]] = {"accel": load_accel}
    if accelerate:
        loaders["Accelerate"] = load_accelerate
    report["load"] = load_report = {
        "model": "GPT-2 124M shape" if plumbing.on_gpu(device) else "GPT-2 layout, width 64",
        "accelerate": "measured" if accelerate else "skipped: accelerate is not installed",
        "repeats": args.load_repeats, "variants": {},
    }  # fmt: skip
    ids = torch.arange(64).view(1, 64).to(device) % shape.vocab
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        folder = Path(tmp) / "gpt2"
        accel.save_model(accel.RunContext.single(device="cpu"), plumbing.make_gpt2(shape), folder)
        for map_name, device_map in maps.items():
            times: dict[str, list[float]] = {n: [] for n in loaders}
            outputs = {}
            for r in range(args.load_repeats + 1):  # the first round warms the page cache
                for name, load in loaders.items():
                    sync(device)
                    start = time.perf_counter()
                    model = load(folder, shape, device_map, Path(tmp))
                    logits = model(ids)
                    sync(device)
                    if r:
                        times[name].append(time.perf_counter() - start)
                    outputs[name] = logits.cpu()
                    del model, logits
            same = all(torch.equal(o, outputs["accel"]) for o in outputs.values())
            load_report["variants"][map_name] = {
                **{f"{n} median_s": statistics.median(ts) for n, ts in times.items()},
                "same_logits": same,
            }
            write(args.out, report)


def fp8_by_hand(sizes: plumbing.LlamaSizes, device: torch.device, compiled: bool) -> Any:
    """torchao's float8 training wired as its README does: convert, compile, autocast."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(module: nn.Module, name: str) -> bool:  # torchao's example: not the head, dims % 16
        assert isinstance(module, nn.Linear)
        return name != "output" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    with torch.device(device):
        model = plumbing.make_llama(sizes)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=plumbing.on_gpu(device))
    return step_by_hand(torch.compile(model) if compiled else model, opt, device)


def tiny_fp8(args: argparse.Namespace, precision: str) -> dict[str, Any]:
    """The dry run's fp8 converts its tiny layers, which the default filter (since issue 34,
    torchao's size thresholds: `skip_small`) leaves in bf16 as too small to gain."""
    fields = {f.name for f in dataclasses.fields(accel.Float8Options)}
    if not args.dry_run or precision != "fp8" or "skip_small" not in fields:
        return {}
    return {"fp8": accel.Float8Options(skip_small=False)}


def time_fp8(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    """accel's step in bf16 and in fp8 (and torchao by hand at dim 4096), compiled, per width."""
    if importlib.util.find_spec("torchao") is None:
        report["fp8"] = {"skipped": "torchao not installed (pip install 'accel-train[fp8]')"}
        return
    report["fp8"] = fp8_report = {"rounds": args.rounds, "steps_per_round": args.steps,
                                  "warmup": args.warmup, "widths": {}}  # fmt: skip
    for dim in args.fp8_dims:
        sizes = (FP8_TINY if args.dry_run else FP8)[dim]
        # Compiled only: eager fp8 ran at 0.29x of eager bf16 on the first run, which no one
        # trains with. The dry run stays eager: tracing float8 through aot_eager on 2 CPU cores
        # took a minute and proves nothing the fp8 tests do not.
        compiled = not args.dry_run
        steps: dict[str, Any] = {}
        for precision in ("bf16", "fp8"):
            ctx = accel.RunContext.single(device=device, precision=precision)
            with torch.device(device):
                model = plumbing.make_llama(sizes)
            model = accel.wrap_model(ctx, model, compile=compiled, **tiny_fp8(args, precision))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=plumbing.on_gpu(device))
            name = "bf16 (accel)" if precision == "bf16" else "fp8 tensorwise (accel)"
            steps[name] = step_with_accel(ctx, model, opt)
        if dim == 4096:
            steps["fp8 tensorwise (torchao by hand)"] = fp8_by_hand(sizes, device, compiled)
        tokens = plumbing.tokens(sizes, steps=1)[0].to(device)
        entry = fp8_report["widths"][f"dim {dim}"] = {"sizes": vars(sizes), "variants": {}}

        def done_round(
            times: dict[str, list[float]], _: dict[str, int], entry: dict[str, Any] = entry
        ) -> None:
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            entry["variants"] = {
                name: {"median_step_s": medians[name], "best_step_s": min(ts),
                       "speedup_over_bf16": medians["bf16 (accel)"] / medians[name]}
                for name, ts in times.items()
            }  # fmt: skip
            write(args.out, report)

        interleave(args, device, steps, tokens, done_round)
        del steps
        if plumbing.on_gpu(device):
            torch.cuda.empty_cache()


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-benchmark.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="a section (all)")
    parser.add_argument("--compile", action="store_true", help="also time the compiled step")
    parser.add_argument("--fp8-dims", type=lambda v: [int(d) for d in v.split(",")],
                        default=list(FP8), help="fp8 widths, of 2048,4096 (both)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds ({ROUNDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps a round ({STEPS})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"warm-up steps ({WARMUP})")
    parser.add_argument("--load-repeats", type=int, default=LOAD_REPEATS, help="GPT-2 loads")
    args = parser.parse_args()
    if not set(args.fp8_dims) <= set(FP8):
        parser.error(f"--fp8-dims={args.fp8_dims} must name widths of {sorted(FP8)}")
    if args.dry_run:
        args.rounds, args.steps, args.load_repeats = 2, 1, 1
    device = torch.device("cpu" if args.dry_run else "cuda", 0 if not args.dry_run else None)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device; run with --dry-run on a CPU.")
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device) if plumbing.on_gpu(device) else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "accelerate": _version("accelerate"), "torchao": _version("torchao"),
    }  # fmt: skip
    # The dry run compiles through aot_eager: dynamo and AOTAutograd trace as on the GPU,
    # without minutes of C++ builds on a CPU (the GPU run compiles with inductor).
    patch = torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager")
    sections = {"step": time_steps, "load": time_loads, "fp8": time_fp8}
    for name in args.only or SECTIONS:
        with patch if args.dry_run else contextlib.nullcontext():
            sections[name](args, device, report)
    report["complete"] = True
    write(args.out, report)
    print(json.dumps(report, indent=2))


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    return str(importlib.import_module(name).__version__)


if __name__ == "__main__":
    main()
