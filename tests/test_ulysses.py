"""Ulysses sequence parallelism: what is refused by name before (or instead of) a wrong result,
and the sequence split of shard_loader, in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import accel
from accel import Parallelism, RunContext
from accel.data._sequence import split_sequence
from accel.parallel._ulysses import _Ulysses, resolve_plan, ulysses
from tests.models import make_model

SP2 = RunContext(rank=0, world_size=2, parallelism=Parallelism(sp=2))


def test_sp_needs_a_plan_and_a_plan_needs_sp() -> None:
    with pytest.raises(ValueError, match=r"sp=2 but sp_plan=None; name the attention modules"):
        accel.wrap_model(SP2, make_model())
    with pytest.raises(ValueError, match=r"sp_plan was given but .* has sp=1"):
        accel.wrap_model(RunContext(), make_model(), sp_plan=("layers.*.attention",))
    with pytest.raises(ValueError, match=r"sp_plan pattern 'blocks\.\*\.attn' names no module"):
        accel.wrap_model(SP2, make_model(), sp_plan=("blocks.*.attn",))
    with pytest.raises(ValueError, match=r"sp=2 needs FSDP2 .* applies 'none'"):
        accel.wrap_model(SP2, make_model(), strategy="none", sp_plan=("layers.*.attention",))
    with pytest.raises(ValueError, match=r"sp_plan='auto' finds transformers' attention"):
        resolve_plan(make_model(), "auto", sp=2, tp=1)
    with pytest.raises(TypeError, match=r"sp_plan=\{'layers': 1\} is not a plan"):
        resolve_plan(make_model(), {"layers": 1}, sp=2, tp=1)


def _hf_attention(**config: object) -> nn.Module:
    module = nn.Module()
    module.config = type("Config", (), {"_attn_implementation": "sdpa", **config})()
    return module


def test_transformers_attention_that_cannot_work_is_refused_by_name() -> None:
    model = nn.Module()
    model.attn = _hf_attention(_attn_implementation="eager")
    with pytest.raises(NotImplementedError, match=r"attn runs attn_implementation='eager'"):
        resolve_plan(model, ("attn",), sp=2, tp=1)
    model.attn = _hf_attention(use_sliding_window=True)
    with pytest.raises(NotImplementedError, match=r"attn uses sliding-window attention"):
        resolve_plan(model, ("attn",), sp=2, tp=1)
    model.attn = _hf_attention(num_attention_heads=12, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2, which tp=1 x sp=4 does not"):
        resolve_plan(model, ("attn",), sp=4, tp=1)
    with pytest.raises(ValueError, match=r"num_attention_heads=12, which tp=2 x sp=4 does not"):
        resolve_plan(model, ("attn",), sp=4, tp=2)
    assert resolve_plan(model, ("attn",), sp=2, tp=1) == ("attn",)


def test_the_attention_call_is_refused_where_ulysses_would_be_wrong() -> None:
    q = torch.ones(1, 3, 4, 2)  # 3 heads
    with _Ulysses("layers.0.attention", None, 2), pytest.raises(ValueError, match="3 query heads"):
        F.scaled_dot_product_attention(q, q, q)
    q = torch.ones(1, 4, 4, 2)
    mask = torch.ones(4, 4, dtype=torch.bool)
    with _Ulysses("attn", None, 2), pytest.raises(NotImplementedError, match=r"a mask of shape"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    linear = nn.Linear(4, 4)  # "attention" that never calls SDPA (eager, linear attention)
    ulysses(linear, "layers.0.attention", None, 2)
    with pytest.raises(RuntimeError, match=r"layers\.0\.attention \(Linear\) ran no"):
        linear(torch.ones(2, 4))


def test_shard_loader_cuts_the_sequence_over_sp_with_global_positions() -> None:
    ids = torch.arange(16).view(2, 8)
    batch = {"input_ids": ids, "labels": ids + 100, "flag": torch.tensor([1, 0])}
    out = split_sequence(batch, 1, 2)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["position_ids"].tolist() == [[4, 5, 6, 7]] * 2  # global positions
    # the last target of a slice is the next slice's first token; the very last is ignored
    assert out["shift_labels"].tolist() == [[105, 106, 107, -100], [113, 114, 115, -100]]
    assert out["flag"].tolist() == [1, 0]  # one value per sample: kept whole
    ctx = RunContext(rank=3, world_size=4, parallelism=Parallelism(sp=4))
    loader = accel.shard_loader(ctx, DataLoader([torch.arange(8)] * 2, batch_size=2))
    assert [b.tolist() for b in loader] == [[[6, 7], [6, 7]]]
    odd = accel.shard_loader(ctx, DataLoader([torch.arange(6)], batch_size=1))
    with pytest.raises(ValueError, match=r"shape \(1, 6\) has sequence length 6 .* sp=4"):
        next(iter(odd))
