"""One GPU: a ~1B Llama-style training step by hand, with accel and with Accelerate; GPT-2 loads.

The step (bf16 autocast over fp32 weights, AdamW, sequence 2048) runs in six variants, each
loop eager and compiled: written by hand with torch.autocast, through accel's calls, and
through Accelerate's `Accelerator` (when installed). They share one set of weights and one
optimizer (the values do not matter to the timing, and six copies of a 1B model would not fit),
and run interleaved in rounds, the order rotating, so drift hits all alike. Reported per
variant: median seconds per step, tokens/s, model FLOPs utilisation against the card's dense
bf16 peak (6 x parameters outside the embedding + 12 x layers x dim x seq per token, no causal
discount), and peak GPU memory. Then a GPT-2-124M-shaped checkpoint is loaded onto the GPU
(and split over GPU, CPU and disk) by `accel.dispatch_checkpoint` and Accelerate's
`load_checkpoint_and_dispatch`, interleaved, with a first forward each, outputs compared.
Last, where torchao can be imported, the same step through accel in bf16 and in fp8
(`precision="fp8"`: torchao float8 Linear layers), eager and compiled, interleaved, on a
4-layer model of the same width and sequence (the matmul shapes of the full model, a quarter of
the compile time); without torchao the section says it was skipped and why.

Results go to --out as JSON, rewritten after every measurement, so a run stopped by its time
limit keeps what it measured. `--dry-run` runs the same code on the CPU at tiny sizes (compile
through the aot_eager backend), as CI does through `make gpu-check DRY_RUN=1`.

    python benchmarks/gpu.py --out gpu-benchmark.json
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
    device: torch.device, sizes: plumbing.LlamaSizes, accelerate: bool
) -> tuple[dict[str, Any], nn.Module]:
    base = plumbing.make_llama(sizes).to(device)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=plumbing.on_gpu(device))
    ctx = accel.RunContext.single(device=device, precision="bf16")
    steps: dict[str, Any] = {}
    for compiled in (False, True):
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


def time_steps(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    sizes = TINY if args.dry_run else FULL
    accelerate = importlib.util.find_spec("accelerate") is not None
    report["step"] = step_report = {
        "sizes": vars(sizes), "rounds": args.rounds, "steps_per_round": args.steps,
        "accelerate": "measured" if accelerate else "skipped: accelerate is not installed",
        "variants": {},
    }  # fmt: skip
    steps, base = build_steps(device, sizes, accelerate)
    step_report["parameters"] = sum(p.numel() for p in base.parameters())
    per_token = flops_per_token(base, sizes)
    step_report["flops_per_token"] = per_token
    peak = peak_flops(report["device"]) if plumbing.on_gpu(device) else None
    step_report["peak_bf16_flops"] = peak
    tokens = plumbing.tokens(sizes, steps=1)[0].to(device)
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
        step_report["variants"] = summarize(times, peaks, sizes, per_token, peak)
        write(args.out, report)


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


def time_fp8(args: argparse.Namespace, device: torch.device, report: dict[str, Any]) -> None:
    """accel's step in bf16 and in fp8 on two copies of one model, eager and compiled."""
    if importlib.util.find_spec("torchao") is None:
        report["fp8"] = {"skipped": "torchao is not installed (pip install 'accel-train[fp8]')"}
        return
    sizes = TINY if args.dry_run else dataclasses.replace(FULL, layers=4)
    report["fp8"] = fp8_report = {"sizes": vars(sizes), "rounds": args.rounds, "variants": {}}
    tokens = plumbing.tokens(sizes, steps=1)[0].to(device)
    steps: dict[str, Any] = {}
    for precision in ("bf16", "fp8"):
        ctx = accel.RunContext.single(device=device, precision=precision)
        for compiled in (False, True):
            torch.manual_seed(0)
            model = accel.wrap_model(ctx, plumbing.make_llama(sizes), compile=compiled)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=plumbing.on_gpu(device))
            mode = "compiled" if compiled else "eager"
            steps[f"{precision}, {mode}"] = step_with_accel(ctx, model, opt)
    times: dict[str, list[float]] = {n: [] for n in steps}
    for step in steps.values():  # warm up: compile, allocator, cuBLAS plans
        for i in range(args.warmup):
            step(tokens, i)
    sync(device)
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for i in range(args.steps):
                steps[name](tokens, i)
            sync(device)
            times[name].append((time.perf_counter() - start) / args.steps)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        fp8_report["variants"] = {
            name: {
                "median_step_s": medians[name],
                "best_step_s": min(ts),
                "speedup_over_bf16": medians[name.replace("fp8", "bf16")] / medians[name],
            }
            for name, ts in times.items()
        }
        write(args.out, report)


def write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-benchmark.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (4)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant a round (3)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--load-repeats", type=int, default=None, help="GPT-2 loads (5)")
    args = parser.parse_args()
    quick = args.dry_run
    args.rounds = args.rounds or (2 if quick else 4)
    args.steps = args.steps or (2 if quick else 3)
    args.load_repeats = args.load_repeats or (1 if quick else 5)
    if quick:
        args.warmup = min(args.warmup, 2)
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
    with patch if args.dry_run else contextlib.nullcontext():
        time_steps(args, device, report)
    time_loads(args, device, report)
    with patch if args.dry_run else contextlib.nullcontext():
        time_fp8(args, device, report)
    report["complete"] = True
    write(args.out, report)
    print(json.dumps(report, indent=2))


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    return str(importlib.import_module(name).__version__)


if __name__ == "__main__":
    main()
