"""Expert parallelism (ep) at 2 and 4 gloo ranks equals the same model at ep=1.

The mixture-of-experts Llama of `tests/models.py` (4 experts, top-2, in each of 2 blocks) trains
20 SGD steps under the device canary (NCCL's rule for the dispatcher's all-to-alls); the parent
trains the same model in one process on the whole global batch. ep ranks see their own data,
so ep=2 at 2 ranks halves each step's batch, as dp_shard=2 would.

Tolerance: 1e-5 relative, for the reasons given in test_sequence_parallel_dist.py: the same
products in another order of sums (an expert's matmul over the tokens of every rank at once,
its gradient reduced by FSDP2 and the dispatcher's 1/ep instead of one sum).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import ExpertParallel, Parallelism
from accel._mesh import with_mesh
from accel.testing import device_canary, run_world
from tests.dist._sgd import train_on_mesh
from tests.models import (
    EP_PLAN,
    MoELlama,
    batches,
    max_relative,
    sgd_reference,
    swiglu_expert,
)

pytestmark = pytest.mark.dist

STEPS, GLOBAL_BATCH, LR, MAX_NORM, RESUME_AT = 20, 4, 0.5, 1.0, 10


def _model() -> MoELlama:
    torch.manual_seed(0)
    return MoELlama()


def _loader_data() -> list[torch.Tensor]:
    return list(batches(STEPS, GLOBAL_BATCH).flatten(0, 1))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _on(ctx: accel.RunContext, parallelism: Parallelism) -> accel.RunContext:
    torch.set_num_threads(1)  # ranks share the cores: one thread each, no oversubscription
    return with_mesh(dataclasses.replace(ctx, parallelism=None, mesh=None), parallelism,
                     source="test")  # fmt: skip


def _train(
    ctx: accel.RunContext, steps: tuple[int, int] = (0, STEPS), state: tuple[str, str] | None = None
) -> dict[str, Any]:
    plan = EP_PLAN if ctx.ep_size > 1 else None
    model = accel.wrap_model(ctx, _model(), ep_plan=plan)
    loader = accel.shard_loader(
        ctx, DataLoader(_loader_data(), batch_size=GLOBAL_BATCH // ctx.dp_size)
    )
    out = train_on_mesh(ctx, model, loader, _loss, lr=LR, max_norm=MAX_NORM, steps=steps,
                        state=state)  # fmt: skip
    inner = accel.unwrap_model(model)
    out["local"] = {n: tuple(q.to_local().shape)
                    for n, q in inner.named_parameters() if "experts" in n}  # fmt: skip
    out["meshes"] = {n: q.device_mesh.mesh_dim_names for n, q in inner.named_parameters()}
    return out


@cache
def _reference() -> dict[str, Any]:
    data = DataLoader(_loader_data(), batch_size=GLOBAL_BATCH)
    return sgd_reference(_model(), data, _loss, lr=LR, max_norm=MAX_NORM)


def _check(out: dict[str, Any]) -> float:
    ref = _reference()
    assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert out["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert max_relative(out["grads"], ref["grads"]) <= 1e-5
    assert max_relative(out["params"], ref["params"]) <= 1e-5
    gaps = [abs(a - b) / b for a, b in zip(out["losses"], ref["losses"], strict=True)]
    return max(*gaps, max_relative(out["params"], ref["params"]))


def _capacity(ctx: accel.RunContext) -> dict[str, Any]:
    """One forward with capacity 0.5: what was routed and dropped on this rank."""
    style = ExpertParallel(expert_fn=swiglu_expert, capacity_factor=0.5)
    model = accel.wrap_model(ctx, _model(), ep_plan={"layers.*.moe.experts": style})
    tokens = batches(1, GLOBAL_BATCH)[0].chunk(ctx.dp_size)[ctx.dp_rank].to(ctx.device)
    with torch.no_grad():
        model(tokens[:, :-1])
    experts = accel.unwrap_model(model).layers[0].moe.experts
    return {"routed": experts.tokens_per_expert.tolist(), "dropped": int(experts.dropped_tokens)}


def _two_ranks(ctx: accel.RunContext, folder: str) -> dict[str, Any]:
    whole = _train(_on(ctx, Parallelism(ep=2)))
    _train(_on(ctx, Parallelism(ep=2)), (0, RESUME_AT), ("save", folder))
    resumed = _train(_on(ctx, Parallelism(dp_shard=2)), (RESUME_AT, STEPS), ("load", folder))
    return {"whole": whole, "resumed": resumed, "capacity": _capacity(_on(ctx, Parallelism(ep=2)))}


def test_ep2_equals_ep1_over_20_steps_resumes_at_ep1_and_counts_dropped_tokens(
    tmp_path: Path,
) -> None:
    with device_canary():
        results = run_world(_two_ranks, world_size=2, args=(str(tmp_path / "s"),), timeout=300)
    ref = _reference()
    worst = max(_check(out["whole"]) for out in results)
    print(f"largest relative gap to ep=1 over {STEPS} steps: {worst:.1e}")
    for out in results:
        whole = out["whole"]
        assert whole["local"]["layers.0.moe.experts.w1"] == (2, 32, 16)  # 2 of the 4 experts
        assert whole["meshes"]["layers.0.moe.experts.w1"] == ("ep",)
        assert whole["meshes"]["layers.0.moe.router.weight"] == ("ep",)  # FSDP2 over dp x ep
        assert out["resumed"]["losses"] == pytest.approx(ref["losses"][RESUME_AT:], rel=1e-5)
        assert max_relative(out["resumed"]["params"], ref["params"]) <= 1e-5
    # capacity ceil(0.5 x 16 tokens x top-2 / 4 experts) = 4 per expert on each rank
    model = _model()
    for rank, out in enumerate(results):
        tokens = batches(1, GLOBAL_BATCH)[0].chunk(2)[rank][:, :-1]
        with torch.no_grad():
            block, x = model.layers[0], model.tok_embeddings(tokens)
            x = x + block.attention(block.attention_norm(x))
            index = block.moe.router(block.ffn_norm(x).flatten(0, 1)).softmax(-1).topk(2).indices
        routed = torch.bincount(index.flatten(), minlength=4)
        assert out["capacity"]["routed"] == routed.tolist()
        assert out["capacity"]["dropped"] == int((routed - 4).clamp(min=0).sum()) > 0


def _four_ranks(ctx: accel.RunContext) -> dict[str, Any]:
    return _train(_on(ctx, Parallelism(dp_shard=2, ep=2)))


def test_ep2_x_dp_shard2_equals_ep1_over_20_steps() -> None:
    with device_canary():
        results = run_world(_four_ranks, world_size=4, timeout=300)
    for out in results:
        _check(out)
        # experts: ep splits them, FSDP2 shards them over dp_shard only (never over ep twice)
        assert out["meshes"]["layers.0.moe.experts.w1"] == ("dp_shard", "ep")
        assert out["local"]["layers.0.moe.experts.w1"] == (1, 32, 16)
        assert out["meshes"]["layers.0.moe.router.weight"] == ("dp",)  # dp_shard x ep
