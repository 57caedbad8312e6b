"""wrap_model's choices from ctx.parallelism, checked without a process group: bad combinations
fail before anything is sharded, naming the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest

import accel
from accel import FSDPOptions, Parallelism, RunContext
from tests.models import TP_PLAN, HFLike, make_model


def _ctx(**sizes: int) -> RunContext:
    p = Parallelism(**sizes)
    world = p.dp_replicate * p.dp_shard * p.cp * p.tp
    return RunContext(rank=0, world_size=world, parallelism=p)


@pytest.mark.parametrize(
    ("sizes", "kwargs", "error", "match"),
    [
        ({"tp": 2}, {"tp_plan": {"layers.*.attn.wq": "colwise"}}, ValueError,
         r"tp_plan pattern 'layers\.\*\.attn\.wq' names no module of Llama; module names look"),
        ({"tp": 3}, {"tp_plan": TP_PLAN}, ValueError,
         r"tp_plan\['layers\.\*\.attention\.wq'\]='colwise' splits "
         r"layers\.0\.attention\.wq\.weight "
         r"dim 0 of size 16 over tp=3, which does not divide it"),
        ({"tp": 2}, {"tp_plan": {"layers.*.attention": "colwise"}}, ValueError,
         r"names 'layers\.0\.attention', a Attention; 'colwise' and 'rowwise' apply to nn\.Linear"),
        ({"tp": 2}, {"tp_plan": {"layers.*.attention.wq": "sequence"}}, ValueError,
         r"tp_plan\['layers\.\*\.attention\.wq'\]='sequence' is not a style accel applies"),
        ({"tp": 2}, {}, ValueError, r"ctx\.parallelism has tp=2 but tp_plan=None"),
        ({"dp_shard": 2}, {"tp_plan": TP_PLAN}, ValueError,
         r"tp_plan was given but nothing is split"),
        ({"tp": 2}, {"tp_plan": TP_PLAN, "fsdp": FSDPOptions()}, ValueError,
         r"fsdp options were given but strategy='auto' shards nothing"),
        ({"dp_replicate": 2, "tp": 2}, {"tp_plan": TP_PLAN}, NotImplementedError,
         r"DDP over dp_replicate=2 with tp=2 is not supported.*Parallelism\(dp_shard=2, tp=2\)"),
        ({"dp_shard": 2}, {"strategy": "ddp"}, ValueError, r"strategy='ddp' but ctx\.parallelism="),
        ({"dp_replicate": 2}, {"strategy": "fsdp2"}, ValueError,
         r"strategy='fsdp2' but ctx\.parallelism="),
        ({"tp": 2}, {"tp_plan": "auto"}, ValueError,
         r"tp_plan='auto' reads model\.config\.base_model_tp_plan, which Llama does not have"),
        ({"dp_shard": 2}, {"fsdp": FSDPOptions(layer_classes=("DecoderLayer",))}, ValueError,
         r"layer class 'DecoderLayer' matches no submodule of Llama; its module classes are"),
        ({"dp_shard": 2}, {"compile": "fast"}, ValueError, r"compile='fast' must be False, True"),
        ({"dp_shard": 2}, {"fsdp": FSDPOptions(offload_params=True)}, NotImplementedError,
         r"offload_params=True\) moves sharded parameters from an accelerator"),
    ],
)  # fmt: skip
def test_wrong_combinations_name_the_value_and_the_fix(
    sizes: dict[str, int], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        accel.wrap_model(_ctx(**sizes), make_model(), **kwargs)


def test_a_hugging_face_plan_with_a_style_accel_does_not_map_is_refused() -> None:
    model = HFLike({"layers.*.attention.wq": "colwise_rep"})
    with pytest.raises(
        ValueError, match=r"tp_plan\['model\.layers\.\*\.attention\.wq'\]='colwise_rep'"
    ):
        accel.wrap_model(_ctx(tp=2), model, tp_plan="auto")


def test_a_split_world_without_a_mesh_says_how_to_build_one() -> None:
    with pytest.raises(
        RuntimeError, match=r"has no DeviceMesh; build it with accel\.init_distributed"
    ):
        accel.wrap_model(_ctx(dp_shard=2, tp=2), make_model(), tp_plan=TP_PLAN)
