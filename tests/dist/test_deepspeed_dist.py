"""DeepSpeed ZeRO 1-3 under accel's unchanged loop give the losses of the same model under DDP.

One world of 2 gloo ranks on the CPU runs every case: a real DeepSpeed engine (ZeRO-1, ZeRO-2,
ZeRO-3, ZeRO-3 with the optimizer offloaded to the CPU; fp32 and bf16) driven by `accumulate`,
`autocast`, `scaled_backward`, `clip_grad_norm_` and `optimizer_step`, against accel's DDP path
with the same optimizer, data and accumulation 2. After each ZeRO-3 run, `save_model` of the
engine writes the files `save_model` writes for the same weights in a plain model.

Tolerances. fp32: both runs compute the same sums; only the order of the gradient reduction
differs (DeepSpeed reduce-scatters flat buckets and averages, DDP all-reduces a bucket and
divides), a few ulps (u = 2**-24) per step that AdamW's normalised update carries into the
weights at most lr * (relative gradient error); over STEPS steps of loss ~1 that stays far
below 1e-5 relative, which is the bound. bf16: DeepSpeed keeps bf16 weights, computes and
reduces bf16 gradients and keeps fp32 master weights; DDP keeps fp32 weights under bf16
autocast, so forward values agree (the same fp32 master rounded to bf16) but its gradients are
fp32. Gradients differ by bf16 rounding, u = 2**-8 relative; the model output each loss is
computed from is rounded to bf16 (one u), and the weights differ by lr * u per step, so the
losses may differ by a few u: the bound is 4u = 2**-6 relative.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import device_canary, run_world

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3  # optimizer steps
ACCUM = 2
MICRO = 4  # samples per rank per forward
LR = 1e-2
CLIP = 1.0
CASES = (  # (name, ZeRO stage, offload the optimizer, precision)
    ("zero1-fp32", 1, False, "fp32"),
    ("zero2-fp32", 2, False, "fp32"),
    ("zero3-fp32", 3, False, "fp32"),
    ("zero3-offload-fp32", 3, True, "fp32"),
    ("zero2-bf16", 2, False, "bf16"),
    ("zero3-bf16", 3, False, "bf16"),
)
RTOL = {"fp32": 1e-5, "bf16": 2**-6}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def _batches(ctx: accel.RunContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUM * MICRO * ctx.world_size
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    rows = range(ctx.rank * MICRO, n, MICRO * ctx.world_size)  # this rank's micro-batches
    return [(x[r : r + MICRO].to(ctx.device), y[r : r + MICRO].to(ctx.device)) for r in rows]


def _train(
    ctx: accel.RunContext, model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[float]:
    """The user's loop, identical for every strategy."""
    losses = []
    for step, (xb, yb) in enumerate(_batches(ctx)):
        with accel.accumulate(ctx, model, step) as sync:
            with accel.autocast(ctx):
                loss = F.mse_loss(model(xb).float(), yb)
            accel.scaled_backward(ctx, loss)
        if sync:
            accel.clip_grad_norm_(ctx, model, CLIP)
            assert accel.optimizer_step(ctx, optimizer)
            optimizer.zero_grad()
        losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
    return losses


def _ds_config(stage: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    zero["stage3_gather_16bit_weights_on_model_save"] = True  # save_model gathers ZeRO-3
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": CLIP,
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        # a torch optimizer with offload: DeepSpeed's own rule asks for this opt-in
        "zero_force_ds_cpu_optimizer": False,
    }


def _launcher_env(ctx: accel.RunContext) -> None:
    """What torchrun (accel launch) exports and DeepSpeed reads; run_world's ranks lack it."""
    for key, value in (
        ("RANK", ctx.rank),
        ("LOCAL_RANK", ctx.local_rank),
        ("WORLD_SIZE", ctx.world_size),
        ("LOCAL_WORLD_SIZE", ctx.world_size),
    ):
        os.environ[key] = str(value)  # this spawned rank's own environment


def _check_save_model(ctx: accel.RunContext, engine: Any, folder: Path) -> None:
    """save_model of the engine == save_model of the same weights in a plain, unsharded model.

    The reference weights come from DeepSpeed's own consolidation (rank 0 gathers them), not
    from the path save_model takes.
    """
    accel.save_model(ctx, engine, folder / "engine")
    # The module you built, partitioned by ZeRO-3, leads to its engine: the same whole weights.
    accel.save_model(ctx, accel.unwrap_model(engine), folder / "module")
    full = engine._zero3_consolidated_16bit_state_dict()  # collective; whole on rank 0 only
    if ctx.rank == 0:
        plain = _model().to(next(iter(full.values())).dtype)
        plain.load_state_dict(full)
        accel.save_model(accel.RunContext.single(), plain, folder / "plain")
        ours, theirs = (
            folder / "engine" / "model.safetensors",
            folder / "plain" / "model.safetensors",
        )
        assert ours.read_bytes() == theirs.read_bytes()
        assert (folder / "module" / "model.safetensors").read_bytes() == theirs.read_bytes()
        fresh = _model().to(plain[0].weight.dtype)
        accel.load_checkpoint_in_model(fresh, folder / "engine")
        for a, b in zip(fresh.state_dict().values(), full.values(), strict=True):
            assert torch.equal(a, b)
    accel.wait_for_everyone(ctx)


class _Tied(nn.Module):
    """An embedding and an output head that share one weight, as GPT-2's do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _check_tied_save(ctx: accel.RunContext, stage: int, folder: Path) -> None:
    """save_model of an engine whose module ties two weights writes the plain model's file:
    the weight once, the tie in the metadata."""
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    options = accel.DeepSpeedOptions(
        config=_ds_config(stage, False), optimizer=optimizer, micro_batch_size=MICRO
    )
    engine = accel.wrap_model(ctx, model, strategy="deepspeed", deepspeed=options)
    accel.save_model(ctx, engine, folder / "engine")
    if ctx.rank == 0:
        accel.save_model(accel.RunContext.single(), _Tied(), folder / "plain")
        plain = (folder / "plain" / "model.safetensors").read_bytes()
        assert (folder / "engine" / "model.safetensors").read_bytes() == plain, stage
    accel.wait_for_everyone(ctx)


def _world(ctx: accel.RunContext, tmp: str) -> dict[str, Any]:
    _launcher_env(ctx)
    ctx = dataclasses.replace(ctx, grad_accum_steps=ACCUM)
    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        c = dataclasses.replace(ctx, precision=precision)
        ddp = accel.wrap_model(c, _model(), strategy="ddp")
        out[f"ddp-{precision}"] = _train(c, ddp, torch.optim.AdamW(ddp.parameters(), lr=LR))
    untrained = _model().to(ctx.device)
    out["untrained"] = [
        accel.reduce(ctx, F.mse_loss(untrained(xb), yb).detach(), op="mean").item()
        for xb, yb in _batches(ctx)
    ]
    for name, stage, offload, precision in CASES:
        c = dataclasses.replace(ctx, precision=precision)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        options = accel.DeepSpeedOptions(
            config=_ds_config(stage, offload), optimizer=optimizer, micro_batch_size=MICRO
        )
        engine = accel.wrap_model(c, model, strategy="deepspeed", deepspeed=options)
        assert accel.deepspeed_engine(engine) is engine
        assert accel.deepspeed_engine(optimizer) is engine
        assert accel.unwrap_model(engine) is model
        out[name] = _train(c, engine, optimizer)
        out[f"{name}-steps"] = engine.global_steps
        if stage == 3:
            _check_save_model(c, engine, Path(tmp) / name)
            engine.save_checkpoint(str(Path(tmp) / name / "zero"))  # for merge-weights
    for stage in (1, 3):
        _check_tied_save(ctx, stage, Path(tmp) / f"tied-zero{stage}")
    return out


def _check_merge_weights(folder: Path) -> None:
    """`accel merge-weights` of a ZeRO checkpoint == save_model of the engine (fp32: the
    master weights are the module's). Run as the command: importing deepspeed writes
    os.environ, which this test process must not have changed."""
    from safetensors.torch import load_file

    def merge(*flags: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "accel", "merge-weights", *flags, "zero", "merged"]
        return subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=120)

    refused = merge()
    assert refused.returncode != 0 and "torch.save pickles" in refused.stderr, refused.stderr
    assert not (folder / "merged").exists()
    done = merge("--trust_pickle")
    assert done.returncode == 0, done.stderr[-3000:]
    merged = load_file(folder / "merged" / "model.safetensors")
    saved = load_file(folder / "engine" / "model.safetensors")
    assert merged.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(merged[key], value), key


def test_zero_stages_match_ddp_and_save_model_gathers_zero3(tmp_path: Path) -> None:
    with device_canary():  # as on GPUs: NCCL's rule for collectives, batches on the device
        results = run_world(_world, world_size=2, timeout=600, args=(str(tmp_path),))
    assert results[0] == results[1]  # the reduced losses agree across ranks
    r = results[0]
    for name, _, _, precision in CASES:
        ref = torch.tensor(r[f"ddp-{precision}"])
        got = torch.tensor(r[name])
        assert len(got) == STEPS * ACCUM
        assert r[f"{name}-steps"] == STEPS  # the engine stepped once per window
        torch.testing.assert_close(got, ref, rtol=RTOL[precision], atol=0, msg=name)
    for name, _, _, precision in CASES:  # merge-weights of the engine's own ZeRO checkpoint
        if name.startswith("zero3") and precision == "fp32":
            _check_merge_weights(tmp_path / name)
    # training moved the losses: after the first window they are not the untrained model's
    moved = torch.tensor(r["ddp-fp32"][ACCUM:]) - torch.tensor(r["untrained"][ACCUM:])
    assert moved.abs().min() > 1e-3
