"""transformers models, as a user trains them: a Llama under sequence parallelism (sp=2) and a
Mixtral under expert parallelism (ep=2) at 2 gloo ranks give the losses of the same model in
one process. The models are built offline from config objects (tiny sizes, no download), with
attn_implementation "sdpa"; the presets find their attention and experts modules
(sp_plan="auto", ep_plan="auto"). Tolerance 1e-5 relative, as in test_sequence_parallel_dist.py.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import Parallelism
from accel.testing import device_canary, run_world

pytestmark = pytest.mark.dist

STEPS, BATCH, SEQ, VOCAB = 10, 4, 16, 64


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=SEQ)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).repeat(STEPS, 1)  # learnable
    ids[1, SEQ - 3 :] = -100  # a few unscored targets: the count must hold them out
    return [{"input_ids": r.clamp(min=0), "labels": r} for r in ids]


def _train(ctx: accel.RunContext, which: str) -> list[float]:
    torch.set_num_threads(1)  # ranks share the cores: one thread each
    if which == "llama":
        model = accel.wrap_model(ctx, _llama(), sp_plan="auto")
    else:
        model = accel.wrap_model(ctx, _mixtral(), ep_plan="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = accel.shard_loader(ctx, DataLoader(_rows(), batch_size=BATCH // ctx.dp_size))
    world = dataclasses.replace(ctx, parallelism=None, mesh=None)
    losses = []
    for batch in loader:
        # the recipe of docs/parallelism.md: a sum over this rank's targets divided by the
        # global count, scaled by the ranks FSDP2 averages over (dp x sp)
        n = accel.num_items_in_batch(ctx, [batch], shift=True)
        loss = model(**batch, num_items_in_batch=n).loss
        accel.scaled_backward(ctx, loss * ctx.dp_size * ctx.sp_size)
        accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        losses.append(accel.reduce(world, loss.detach(), op="sum").item())
    return losses


@cache
def _reference(which: str) -> list[float]:
    model = _llama() if which == "llama" else _mixtral()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in DataLoader(_rows(), batch_size=BATCH):
        loss = model(**batch).loss  # transformers' own mean over every scored target
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _both(ctx: accel.RunContext) -> dict[str, list[float]]:
    """One world (transformers is imported once per rank) runs both meshes in turn."""
    from accel._mesh import with_mesh

    ctx = dataclasses.replace(ctx, parallelism=None, mesh=None)
    return {
        which: _train(with_mesh(ctx, mesh, source="test"), which)
        for which, mesh in (("llama", Parallelism(sp=2)), ("mixtral", Parallelism(ep=2)))
    }


def test_a_llama_at_sp2_and_a_mixtral_at_ep2_train_as_in_one_process() -> None:
    with device_canary():
        results = run_world(_both, world_size=2, timeout=300)
    for which in ("llama", "mixtral"):
        expected = _reference(which)
        for out in results:
            assert out[which] == pytest.approx(expected, rel=1e-5), which
        assert expected[-1] < expected[0]  # it learns (the same rows recur)
