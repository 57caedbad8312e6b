"""N-D parallelism at 4 gloo ranks equals the one-process full-batch reference.

Each mesh shape trains the small Llama-style model of `tests/models.py` for a few optimizer steps
with accumulation 2 and gradient clipping; the parent trains the same model on the whole global
batch in one process. Parameters, losses and gradient norms must agree to float reduction order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import cache
from typing import Any

import pytest
import torch

import accel
from accel import FSDPOptions, Parallelism
from accel.testing import device_canary, run_world
from tests.models import TP_PLAN, Block, batches, full_param, lm_loss, make_model, reference

pytestmark = pytest.mark.dist

STEPS, GLOBAL_BATCH, ACCUM, LR, MAX_NORM = 3, 8, 2, 0.5, 0.5

MESHES = {
    "fsdp2xtp2": (Parallelism(dp_shard=2, tp=2), {}),
    "hsdp2x2": (Parallelism(dp_replicate=2, dp_shard=2), {}),
    "tp4": (Parallelism(tp=4), {}),
    "fsdp4_activation_checkpointing": (Parallelism(dp_shard=4), {"ac": True}),
    "fsdp2xtp2_regional_compile": (Parallelism(dp_shard=2, tp=2), {"compile": "regional"}),
}


def _train(ctx: accel.RunContext, options: dict[str, Any]) -> dict[str, Any]:
    ctx = dataclasses.replace(ctx, grad_accum_steps=ACCUM)
    p = ctx.parallelism
    assert p is not None
    fsdp = FSDPOptions(layer_classes=(Block,)) if p.dp_shard > 1 else None
    model = accel.wrap_model(
        ctx, make_model(), tp_plan=TP_PLAN if p.tp > 1 else None, fsdp=fsdp,
        compile=options.get("compile", False), activation_checkpointing=options.get("ac", False),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    attention_calls = [0]  # twice per micro-step when activations are recomputed in backward
    inner = accel.unwrap_model(model)
    inner.layers[0].attention.register_forward_pre_hook(
        lambda *_: attention_calls.__setitem__(0, attention_calls[0] + 1)
    )
    dp = accel.along(ctx, "dp")
    per_rank = GLOBAL_BATCH // ctx.dp_size
    micro = per_rank // ACCUM
    losses, norms = [], []
    for step, tokens in enumerate(batches(STEPS, GLOBAL_BATCH)):
        mine = tokens[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank].to(ctx.device)
        total = torch.zeros((), device=ctx.device)
        for m in range(ACCUM):
            with accel.accumulate(ctx, model, step * ACCUM + m):
                loss = lm_loss(model, mine[m * micro : (m + 1) * micro])
                accel.scaled_backward(ctx, loss)
            total += loss.detach() / ACCUM
        norms.append(accel.clip_grad_norm_(ctx, model, MAX_NORM).item())
        assert accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        losses.append(accel.reduce(dp, total, op="mean").item())
    meshes = {
        name: tuple(q.device_mesh.mesh_dim_names) if hasattr(q, "device_mesh") else None
        for name, q in inner.named_parameters()
    }
    params = {name: full_param(q) for name, q in inner.named_parameters()}
    groups = {
        dim: accel.gather(accel.along(ctx, dim), torch.tensor([ctx.rank])).tolist()
        for dim in ("dp", "tp")
    }
    compiled = [getattr(b, "_compiled_call_impl", None) is not None for b in inner.layers]
    return {"losses": losses, "norms": norms, "params": params if ctx.rank == 0 else None,
            "meshes": meshes, "groups": groups, "attention_calls": attention_calls[0],
            "compiled": compiled}  # fmt: skip


@cache
def _reference() -> dict[str, Any]:
    return reference(batches(STEPS, GLOBAL_BATCH), lr=LR, max_norm=MAX_NORM)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(MESHES))
def test_parameters_losses_and_norms_equal_the_full_batch_reference(name: str) -> None:
    parallelism, options = MESHES[name]
    # inductor compiles on 4 ranks of 2 cores: 82 s on an idle machine with torch 2.11's build,
    # past 120 s on a loaded one; the test's own limit is 300 s
    timeout = 270 if options.get("compile") else 120
    # Under the device canary: batches on the device and NCCL's rule for collectives, as on
    # GPUs. Not the compiled mesh: under the canary's torch modes torch.compile compiles nothing.
    canary = contextlib.nullcontext() if options.get("compile") else device_canary()
    with canary:
        results = run_world(_train, world_size=4, args=(options,), parallelism=parallelism,
                            timeout=timeout)  # fmt: skip
    ref = _reference()
    for rank, out in enumerate(results):
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-5), rank
    params = results[0]["params"]
    assert params.keys() == ref["params"].keys()
    worst = max(_close(params[n], ref["params"][n]) for n in params)
    assert worst <= 1e-5, worst
    # The model really is split as the mesh says: TP layers on tp, the rest sharded over dp.
    meshes = results[0]["meshes"]
    wq, norm = meshes["layers.0.attention.wq.weight"], meshes["norm.weight"]
    expected = {
        "fsdp2xtp2": (("dp_shard", "tp"), ("dp_shard",)),
        "fsdp2xtp2_regional_compile": (("dp_shard", "tp"), ("dp_shard",)),
        "hsdp2x2": (("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard")),
        "tp4": (("tp",), None),
        "fsdp4_activation_checkpointing": (("dp_shard",), ("dp_shard",)),
    }[name]
    assert (wq, norm) == expected
    recomputed = options.get("ac", False)
    if options.get("compile") != "regional":  # a compiled block runs its hooks when traced
        assert results[0]["attention_calls"] == STEPS * ACCUM * (2 if recomputed else 1)
    assert results[0]["compiled"] == [options.get("compile") == "regional"] * 2
    sizes = parallelism.resolve(4)
    for rank, out in enumerate(results):
        tp_peers = [r for r in range(4) if r // sizes.tp == rank // sizes.tp]
        dp_peers = [r for r in range(4) if r % sizes.tp == rank % sizes.tp]
        assert out["groups"] == {"tp": tp_peers, "dp": dp_peers}


def _data_over_dp(ctx: accel.RunContext) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    loader = accel.shard_loader(ctx, DataLoader(list(range(10)), batch_size=2))
    gathered, batches = [], []
    for batch in loader:
        batches.append(batch.tolist())
        gathered.extend(accel.gather_for_metrics(ctx, batch, loader=loader).tolist())
    labels = torch.full((3,), ctx.dp_rank)  # tp peers hold the same labels
    return {
        "batches": batches,
        "gathered": gathered,
        "num_items": accel.num_items_in_batch(ctx, [labels], shift=False),
    }


def test_data_is_sharded_gathered_and_counted_over_the_data_parallel_ranks() -> None:
    results = run_world(_data_over_dp, world_size=4, parallelism=Parallelism(dp_shard=2, tp=2))
    seen = [r["batches"] for r in results]
    assert seen == [[[0, 1], [4, 5], [8, 9]]] * 2 + [[[2, 3], [6, 7], [0, 1]]] * 2
    for out in results:
        assert out["gathered"] == list(range(10))  # every sample once, repeats dropped
        assert out["num_items"] == 6  # 3 labels on each of the 2 data-parallel ranks


def _fp16_inf_skips_everywhere(ctx: accel.RunContext) -> dict[str, Any]:
    ctx = dataclasses.replace(ctx, precision="fp16")
    p = ctx.parallelism
    assert p is not None
    fsdp = FSDPOptions(layer_classes=(Block,)) if p.dp_shard > 1 else None
    model = accel.wrap_model(ctx, make_model(), tp_plan=TP_PLAN if p.tp > 1 else None, fsdp=fsdp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = accel.make_scaler(ctx)
    tokens = batches(2, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // ctx.dp_size
    stepped, scales = [], []
    for step in range(2):
        with accel.autocast(ctx):
            loss = lm_loss(
                model, tokens[step, ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank]
            )
        accel.scaled_backward(ctx, loss, scaler=scaler)
        if step == 1 and ctx.rank == 3:  # one rank's own shard of one gradient overflows
            grad = accel.unwrap_model(model).layers[1].feed_forward.w2.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")
        before = [full_param(q) for q in model.parameters()]
        accel.clip_grad_norm_(ctx, model, MAX_NORM, optimizer=opt, scaler=scaler)
        stepped.append(accel.optimizer_step(ctx, opt, scaler=scaler))
        unchanged = all(
            torch.equal(a, full_param(q)) for a, q in zip(before, model.parameters(), strict=True)
        )
        scales.append((scaler.get_scale() if scaler else 0.0, unchanged))
        opt.zero_grad()
    return {"stepped": stepped, "scales": scales}


@pytest.mark.parametrize(
    "parallelism", [Parallelism(dp_shard=2, tp=2), Parallelism(tp=4)], ids=["fsdp2xtp2", "tp4"]
)
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank(parallelism: Parallelism) -> None:
    results = run_world(
        _fp16_inf_skips_everywhere, world_size=4, parallelism=parallelism, timeout=120
    )
    for out in results:
        assert out["stepped"] == [True, False]
        (first, moved), (second, kept) = out["scales"]
        assert not moved and kept and second == first / 2


def _steps(
    ctx: accel.RunContext, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range
) -> None:
    data = batches(STEPS, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // ctx.dp_size
    for step in steps:
        tokens = data[step, ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank]
        accel.scaled_backward(ctx, lm_loss(model, tokens))
        accel.optimizer_step(ctx, opt)
        opt.zero_grad()


def _nd_model(ctx: accel.RunContext) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    p = ctx.parallelism
    assert p is not None
    fsdp = FSDPOptions(layer_classes=(Block,)) if p.dp_shard > 1 else None
    model = accel.wrap_model(
        ctx, make_model(seed=5), tp_plan=TP_PLAN if p.tp > 1 else None, fsdp=fsdp
    )
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_param(q) for n, q in accel.unwrap_model(model).named_parameters()}


def _save_then_step(ctx: accel.RunContext, directory: str) -> dict[str, Any]:
    model, opt = _nd_model(ctx)
    _steps(ctx, model, opt, range(2))
    accel.save_state(ctx, directory, model=model, optimizer=opt)
    saved = _full_state(model)
    _steps(ctx, model, opt, range(2, 3))
    return {"saved": saved, "after": _full_state(model)}


def _load_then_step(ctx: accel.RunContext, directory: str) -> dict[str, Any]:
    model, opt = _nd_model(ctx)
    accel.load_state(ctx, directory, model=model, optimizer=opt)
    loaded = _full_state(model)
    _steps(ctx, model, opt, range(2, 3))
    return {"loaded": loaded, "after": _full_state(model)}


def test_a_checkpoint_saved_at_one_mesh_shape_resumes_at_another(tmp_path: Any) -> None:
    directory = str(tmp_path / "state")
    saved = run_world(
        _save_then_step, world_size=4, args=(directory,), parallelism=Parallelism(dp_shard=2, tp=2)
    )[0]
    resumed = run_world(
        _load_then_step, world_size=4, args=(directory,), parallelism=Parallelism(dp_shard=4)
    )
    one = accel.RunContext.single(device="cpu")
    model = make_model(seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    accel.load_state(one, directory, model=model, optimizer=opt)
    single = {"loaded": _full_state(model)}
    _steps(one, model, opt, range(2, 3))
    single["after"] = _full_state(model)
    for out in [*resumed, single]:
        for name, value in saved["saved"].items():
            assert torch.equal(out["loaded"][name], value), name  # bit-identical
            assert _close(out["after"][name], saved["after"][name]) <= 1e-5, name


def _hf_auto_plan(ctx: accel.RunContext) -> dict[str, Any]:
    from tests.models import HFLike

    plan = {k: v for k, v in TP_PLAN.items()}  # keys relative to the base model, as in HF
    model = accel.wrap_model(ctx, HFLike(plan), tp_plan="auto")
    tokens = batches(1, 2)[0]
    with torch.no_grad():
        out = model.model(tokens)
    wq = model.model.layers[0].attention.wq.weight
    return {"out": out, "wq": (type(wq).__name__, tuple(wq.to_local().shape))}


def test_tp_plan_auto_reads_a_hugging_face_models_base_model_tp_plan() -> None:
    results = run_world(_hf_auto_plan, world_size=2, parallelism=Parallelism(tp=2))
    with torch.no_grad():
        expected = make_model()(batches(1, 2)[0])
    for out in results:
        assert out["wq"] == ("DTensor", (8, 16))  # colwise: 16 output features over tp=2
        assert _close(out["out"], expected) <= 1e-5


def _fsdp_options_apply(ctx: accel.RunContext) -> dict[str, Any]:
    seen: list[torch.dtype] = []

    def record(module: torch.nn.Module, _: Any) -> None:
        seen.append(module.wq.weight.dtype)

    # Different initial weights per rank: sync_module_states makes every rank start from rank 0's.
    options = FSDPOptions(layer_classes=(Block,), sync_module_states=True, param_dtype="bf16")
    model = accel.wrap_model(ctx, make_model(seed=ctx.rank), tp_plan=TP_PLAN, fsdp=options)
    accel.unwrap_model(model).layers[0].attention.register_forward_pre_hook(record)
    lm_loss(model, batches(1, 2)[0]).backward()
    synced = _full_state(model)
    return {"dtype": seen, "synced": synced if ctx.rank == 0 else None}


def test_fsdp_options_sync_module_states_and_set_the_compute_dtype() -> None:
    out = run_world(_fsdp_options_apply, world_size=4, parallelism=Parallelism(dp_shard=2, tp=2))
    reference = make_model(seed=0)
    for name, value in reference.named_parameters():
        assert torch.equal(out[0]["synced"][name], value.detach()), name
    for rank in out:
        assert rank["dtype"] == [torch.bfloat16]  # gathered in param_dtype for compute
