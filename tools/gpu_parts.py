"""The parts of `make gpu-check` that are not pytest or benchmarks/gpu.py: one per subcommand.

Each runs in a process of its own (tools/gpu_check.py starts it under a time limit), writes
its figures as JSON to --json and exits non-zero with one line on stderr when what it checks
does not hold. On a machine without CUDA (the dry run) each runs on the CPU at tiny sizes.

    python tools/gpu_parts.py init --spelling str:cuda --json init.json
    python tools/gpu_parts.py gpt2 --json gpt2.json       # by hand / accel / Accelerate
    python tools/gpu_parts.py offload --json offload.json  # dispatch_checkpoint, item 5
    python tools/gpu_parts.py estimate --json estimate.json  # estimate_memory vs the allocator
    python tools/gpu_parts.py ulysses --json ulysses.json  # sp=1 path unchanged in speed
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class CheckFailed(Exception):
    """What the part checks does not hold (one line)."""


# ---- init_distributed(device=...) with each spelling a user writes -----------------------

# "kind:value" on the command line; the value each spelling must resolve to.
GPU_SPELLINGS = ("str:cuda", "str:cuda:0", "device:cuda", "int:0")
CPU_SPELLINGS = ("str:cpu", "str:cpu:0", "device:cpu")


def parse_spelling(spelling: str) -> Any:
    import torch

    kind, _, value = spelling.partition(":")
    if kind == "str":
        return value
    if kind == "device":
        return torch.device(value)
    if kind == "int":
        return int(value)
    raise ValueError(f"--spelling={spelling!r}: use str:VALUE, device:VALUE or int:N")


def check_init(spelling: str) -> dict[str, Any]:
    """init_distributed(device=spelling), then a bf16 step where data made on ctx.device meets
    the wrapped model. On a GPU every spelling must land on cuda:0 (this rank's local GPU);
    "bad-index" asks for an index one past the last GPU and expects one line naming it."""
    import torch
    import torch.nn.functional as F

    import accel

    if spelling == "bad-index":
        index = torch.cuda.device_count()
        wanted = f"cuda:{index}"
        try:
            accel.init_distributed(device=wanted)
        except Exception as err:  # any type, as long as it is one clear line
            message = str(err)
            named = wanted in message or f"index={index}" in message
            if "\n" in message.strip() or not named:
                raise CheckFailed(f"device={wanted!r}: the error is not one line naming it: "
                                  f"{type(err).__name__}: {message[:300]!r}") from err  # fmt: skip
            return {"spelling": wanted, "error": f"{type(err).__name__}: {message}"}
        raise CheckFailed(f"device={wanted!r} (no such GPU) was accepted")
    value = parse_spelling(spelling)
    ctx = accel.init_distributed(device=value, precision="bf16", seed=0)
    try:
        want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if ctx.device.type != want.type or (want.type == "cuda" and ctx.device != want):
            raise CheckFailed(f"device={value!r} gave ctx.device={ctx.device}, not {want}")
        model = accel.wrap_model(ctx, torch.nn.Sequential(torch.nn.Linear(8, 16),
                                                          torch.nn.Linear(16, 1)))  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = torch.randn(4, 8, device=ctx.device), torch.randn(4, 1, device=ctx.device)
        with accel.autocast(ctx):
            loss = F.mse_loss(model(x), y)
        accel.scaled_backward(ctx, loss)
        accel.optimizer_step(ctx, opt)
        return {"spelling": repr(value), "ctx.device": str(ctx.device), "loss": loss.item()}
    finally:
        accel.shutdown(ctx)


# ---- a transformers GPT-2 trained by hand, through accel and through Accelerate ------------


def gpt2_config(tiny: bool, **extra: Any) -> Any:
    from transformers import GPT2Config

    if tiny:  # the same layout (tied head, dropout on) at width 64
        extra = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
                 "bos_token_id": 0, "eos_token_id": 0, **extra}  # fmt: skip
    return GPT2Config(**extra)  # else GPT-2 124M


def check_gpt2(steps: int) -> dict[str, Any]:
    """The same bf16 training (dropout on, deterministic kernels, AdamW) three ways; the
    losses and final weights must be bit-identical."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2LMHeadModel

    import accel

    # Warn, not raise, where an op has no deterministic kernel: equal losses are the check.
    torch.use_deterministic_algorithms(True, warn_only=True)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    config = gpt2_config(not gpu, attn_implementation="eager")  # sdpa's backward is atomic
    torch.manual_seed(0)
    base = GPT2LMHeadModel(config)
    batch, seq = (4, 256) if gpu else (4, 32)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, config.vocab_size, (steps * batch, seq), generator=g))

    def loader() -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch, shuffle=False)

    def by_hand() -> tuple[list[torch.Tensor], torch.nn.Module]:
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for step, (ids,) in enumerate(loader()):
            ids = ids.to(device)
            torch.manual_seed(step)  # dropout's masks, whatever RNG each loader draws
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, model

    def with_accel() -> tuple[list[torch.Tensor], torch.nn.Module]:
        ctx = accel.init_distributed(device=device, precision="bf16")
        model = accel.wrap_model(ctx, copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = accel.make_scaler(ctx)
        losses = []
        for step, (ids,) in enumerate(accel.shard_loader(ctx, loader())):
            torch.manual_seed(step)
            with accel.accumulate(ctx, model, step) as sync:
                with accel.autocast(ctx):
                    loss = model(input_ids=ids, labels=ids).loss
                accel.scaled_backward(ctx, loss, scaler=scaler)
            if sync:
                accel.optimizer_step(ctx, opt, scaler=scaler)
                opt.zero_grad()
            losses.append(loss.detach())
        accel.shutdown(ctx)
        return losses, accel.unwrap_model(model)

    def with_accelerate() -> tuple[list[torch.Tensor], torch.nn.Module]:
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="bf16", cpu=not gpu)
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt, dl = accelerator.prepare(model, opt, loader())
        losses = []
        for step, (ids,) in enumerate(dl):
            torch.manual_seed(step)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, accelerator.unwrap_model(model)

    loops: dict[str, Callable[[], tuple[list[torch.Tensor], torch.nn.Module]]] = {
        "hand": by_hand, "accel": with_accel}  # fmt: skip
    from importlib.util import find_spec

    if find_spec("accelerate") is not None:
        loops["Accelerate"] = with_accelerate
    losses: dict[str, list[float]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, loop in loops.items():
        got, model = loop()
        losses[name] = torch.stack(got).float().cpu().tolist()
        weights[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        del model
    figures: dict[str, Any] = {
        "model": "GPT-2 124M" if gpu else "GPT-2 layout, width 64",
        "parameters": sum(p.numel() for p in base.parameters()),
        "steps": steps, "batch": [batch, seq], "losses": losses,
        "accelerate": "measured" if "Accelerate" in loops else "skipped: not installed",
    }  # fmt: skip
    for name in loops:
        if losses[name] != losses["hand"]:
            raise CheckFailed(f"{name}'s losses {losses[name]} differ from hand's {losses['hand']}")
        diff = [k for k, v in weights["hand"].items() if not torch.equal(weights[name][k], v)]
        if diff:
            raise CheckFailed(
                f"{name}'s weights differ from hand's after {steps} steps: {diff[:3]}"
            )
    return figures


# ---- dispatch_checkpoint of a saved transformers GPT-2 (tied head) with CPU offload --------


def check_offload() -> dict[str, Any]:
    """save_pretrained, then dispatch_checkpoint with a GPU budget smaller than the model
    (GPU 120 MB, CPU 20 GB; on the CPU: a CPU budget a third of the model, the rest on disk),
    no_split=["GPT2Block"]; the first forward's logits must equal the model loaded whole."""
    import torch
    from transformers import GPT2LMHeadModel

    import accel

    gpu = torch.cuda.is_available()
    config = gpt2_config(not gpu) if gpu else gpt2_config(True, n_layer=12)
    torch.manual_seed(0)
    whole = GPT2LMHeadModel(config).eval()
    size = sum(p.numel() * p.element_size() for p in whole.parameters())
    budget: dict[int | str, int | str] = (
        {0: "120MB", "cpu": "20GB"} if gpu else {"cpu": size // 3}
    )  # fmt: skip
    ids = torch.arange(32).view(2, 16) % config.vocab_size
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        whole.save_pretrained(tmp)
        want = whole(input_ids=ids).logits
        with accel.init_empty_weights():
            empty = GPT2LMHeadModel(config).eval()  # no dropout, as from_pretrained gives
        model = accel.dispatch_checkpoint(
            empty, tmp, device_map="auto", max_memory=budget, no_split=["GPT2Block"],
            offload_dir=Path(tmp) / "offload",
        )  # fmt: skip
        placed = dict(getattr(model, "hf_device_map", {}))
        tied = model.lm_head.weight is model.transformer.wte.weight
        got = model(input_ids=ids.to(0 if gpu else "cpu")).logits.cpu()
    where: dict[str, int] = {}
    for dev in placed.values():
        where[str(dev)] = where.get(str(dev), 0) + 1
    figures = {"model": "GPT-2 124M" if gpu else "GPT-2 layout, width 64",
               "bytes": size, "max_memory": {str(k): v for k, v in budget.items()},
               "modules_per_device": where, "head_tied_to_embedding": tied,
               "max_abs_diff": (got - want).abs().max().item()}  # fmt: skip
    # fp32 throughout; on a GPU the matmuls differ from the CPU's in their last bits
    if not torch.allclose(got, want, rtol=1e-4 if gpu else 0, atol=1e-4 if gpu else 0):
        raise CheckFailed(f"logits differ from the model loaded whole: {figures}")
    if not tied:
        raise CheckFailed("lm_head.weight is no longer transformer.wte.weight after dispatch")
    return figures


# ---- estimate_memory against the CUDA allocator, for benchmarks/gpu.py's 1.2B step -----------


def check_estimate() -> dict[str, Any]:
    """accel.estimate_memory (on the CPU, fake tensors) of the 1.2B step against the same step
    run by hand: torch.cuda.max_memory_allocated must be within 10% of the estimate's peak.
    The allocator's overhead (reserved beyond allocated at the peak) and NCCL's (device memory
    a one-rank NCCL group takes outside the allocator) are measured and reported beside it. On
    the CPU (the dry run) the tiny sizes, and the step measured by accel's own account."""
    import time

    import torch
    import torch.nn.functional as F

    import accel
    from benchmarks.gpu import FULL, TINY
    from tests.gpu import plumbing

    gpu = torch.cuda.is_available()
    sizes = FULL if gpu else TINY
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    start = time.perf_counter()
    estimate = accel.estimate_memory(
        lambda: plumbing.make_llama(sizes), (sizes.batch, sizes.seq),
        config=accel.Config(mixed_precision="bf16"), device=device.type,
    )  # fmt: skip
    estimate_s = time.perf_counter() - start
    with torch.device(device):
        model = plumbing.make_llama(sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # foreach on CUDA, as estimated
    for p in model.parameters():  # the optimizer's state, as the estimate makes it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tokens = torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq), device=device)
    figures: dict[str, Any] = {"model": f"Llama {sizes}", "estimate_seconds": round(estimate_s, 1),
                               "estimate": estimate.as_dict()}  # fmt: skip
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, -2), tokens.flatten())
    del logits
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    if not gpu:  # the dry run: the code path, measured by the account on the CPU
        from accel.estimate._spec import StepSpec
        from accel.estimate._step import run_steps

        spec = StepSpec(build=lambda: plumbing.make_llama(sizes), batch=(sizes.batch, sizes.seq))
        measured = run_steps(accel.RunContext.single(device="cpu", precision="bf16"), spec).peak
        figures["measured_peak_account_cpu"] = measured
    else:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        figures |= _cuda_overheads(measured)
    figures["measured_peak"] = measured
    error = (estimate.peak - measured) / measured
    figures["error"] = round(error, 4)
    if abs(error) > 0.10:
        raise CheckFailed(f"estimate {estimate.peak} B vs measured {measured} B: {error:+.1%}")
    return figures


def _cuda_overheads(allocated: int) -> dict[str, Any]:
    """The caching allocator's and NCCL's memory beyond what the tensors hold, measured."""
    import torch
    import torch.distributed as dist

    reserved = torch.cuda.max_memory_reserved()
    free_before, total = torch.cuda.mem_get_info()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    dist.destroy_process_group()
    nccl = free_before - free_after - x.untyped_storage().nbytes()
    return {"max_memory_allocated": allocated, "max_memory_reserved": reserved,
            "allocator_overhead": reserved - allocated,
            "allocator_overhead_fraction": round((reserved - allocated) / allocated, 4),
            "nccl_one_rank_bytes": nccl, "device_total": total}  # fmt: skip


def check_ulysses(steps: int) -> dict[str, Any]:
    """One GPU: a Llama-style training step by hand, through wrap_model at sp=1 (which must
    install nothing: same speed), and with its attention under Ulysses over a one-rank group
    (the all-to-alls are copies: the cost of the machinery itself). bf16 autocast, AdamW."""
    import time

    import torch
    import torch.distributed as dist

    import accel
    from accel.parallel._ulysses import ulysses
    from tests.models import lm_loss, make_model

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    sizes = {"vocab": 8192, "dim": 1024, "heads": 16, "layers": 8} if gpu else {}
    batch, seq = (8, 1024) if gpu else (2, 16)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)  # fmt: skip
    try:
        ctx = accel.RunContext.single(device=device, precision="bf16")
        tokens = torch.randint(0, sizes.get("vocab", 32), (batch, seq + 1), device=device)
        models = {"hand": make_model(**sizes).to(device),
                  "accel sp=1": accel.wrap_model(ctx, make_model(**sizes)),
                  "ulysses, one rank": make_model(**sizes).to(device)}  # fmt: skip
        if any("forward" in vars(m) for m in models["accel sp=1"].modules()):
            raise CheckFailed("wrap_model at sp=1 replaced a module's forward")
        for i, block in enumerate(models["ulysses, one rank"].layers):
            ulysses(block.attention, f"layers.{i}.attention", dist.group.WORLD, 1)
        optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        losses: dict[str, float] = {}
        for step in range(steps + 2):  # two warm-up steps
            for name in models if step % 2 else reversed(list(models)):
                if gpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = lm_loss(models[name], tokens)
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad()
                losses[name] = loss.item()  # syncs
                if step >= 2:
                    times[name].append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    best = {k: min(v) for k, v in times.items()}
    figures = {"device": str(device), "sizes": sizes or "tests.models defaults",
               "batch_x_seq": [batch, seq], "steps": steps,
               "best_s": best, "losses_last_step": losses,
               "accel_sp1_over_hand": best["accel sp=1"] / best["hand"],
               "ulysses_one_rank_over_hand": best["ulysses, one rank"] / best["hand"]}  # fmt: skip
    if gpu and figures["accel_sp1_over_hand"] > 1.02:
        raise CheckFailed(f"the sp=1 step is slower than by hand: {figures}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("init", "gpt2", "offload", "estimate", "ulysses"))
    parser.add_argument("--json", type=Path, help="where the figures go")
    parser.add_argument("--spelling", default="str:cpu", help="init: kind:value, or bad-index")
    parser.add_argument("--steps", type=int, default=8, help="gpt2: optimizer steps (8)")
    args = parser.parse_args()
    try:
        if args.part == "init":
            figures: dict[str, Any] = check_init(args.spelling)
        elif args.part == "gpt2":
            figures = check_gpt2(args.steps)
        elif args.part == "estimate":
            figures = check_estimate()
        elif args.part == "ulysses":
            figures = check_ulysses(args.steps)
        else:
            figures = check_offload()
    except CheckFailed as err:
        print(f"gpu_parts {args.part}: {err}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
