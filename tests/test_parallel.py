"""wrap_model's choices from ctx.parallelism, checked without a process group: bad combinations
fail before anything is sharded, naming the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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
        # Issue 37 item 12: these two spoke of the mesh and the process group, not the argument.
        ({"tp": 2}, {"tp_plan": {}}, ValueError,
         r"wrap_model: tp_plan=\{\} names no module to split, and ctx\.parallelism has tp=2; "
         r"expected at least one pattern.*Parallelism\(tp=1\)"),
        ({"cp": 2}, {}, NotImplementedError,
         r"wrap_model: ctx\.parallelism\.cp=2 needs CUDA devices .* this run is on "
         r"'cpu'\. Use cp=1"),
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


# Issue 29 item 7: arguments of wrap_model and FSDPOptions that reached a bare Python or torch
# error, or were accepted; each error names the argument, the value and what is allowed.
@pytest.mark.parametrize(
    ("tp_plan", "match"),
    [
        ("colwise", r"tp_plan='colwise' is not a plan; expected a dict of module-name pattern"),
        ([("layers.*.attention.wq", "colwise")], r"tp_plan=\[\('layers.*is not a plan"),
        ({0: "colwise"}, r"tp_plan key 0 is not a module-name pattern; expected a str"),
    ],
)
def test_a_tp_plan_that_is_not_a_dict_of_patterns_is_refused_by_name(
    tp_plan: Any, match: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        accel.wrap_model(_ctx(tp=2), make_model(), tp_plan=tp_plan)


def test_a_torch_colwise_style_on_a_module_it_cannot_split_is_refused_by_name() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(
        ValueError,
        match=r"tp_plan\['layers\.\*\.attention'\]=ColwiseParallel.*names 'layers\.0\.attention'"
        r", a Attention; ColwiseParallel and RowwiseParallel apply to nn\.Linear and nn\.Embedding",
    ):
        accel.wrap_model(
            _ctx(tp=2), make_model(), tp_plan={"layers.*.attention": ColwiseParallel()}
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reduce_dtype": torch.int32}, ValueError,
         r"FSDPOptions: reduce_dtype=torch\.int32 is not a floating dtype"),
        ({"param_dtype": "int8"}, ValueError,
         r"FSDPOptions: param_dtype='int8' is not a floating dtype"),
        ({"reshard_after_forward": "yes"}, TypeError,
         r"FSDPOptions: reshard_after_forward='yes' must be True or False"),
        ({"offload_params": 1}, TypeError, r"FSDPOptions: offload_params=1 must be True or False"),
    ],
)  # fmt: skip
def test_fsdp_options_refuse_values_fsdp2_cannot_honour(
    kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        FSDPOptions(**kwargs)


def test_ddp_with_tensor_parallel_alone_suggests_a_mesh_that_works() -> None:
    # tp=2 over 2 ranks: nothing to replicate, so the fix is TP alone, not the same mesh again.
    with pytest.raises(NotImplementedError) as info:
        accel.wrap_model(_ctx(tp=2), make_model(), tp_plan=TP_PLAN, strategy="ddp")
    message = str(info.value)
    assert "strategy='ddp'" in message and "tp=2" in message
    assert "Parallelism(dp_shard=1, tp=2)" not in message
    assert "strategy='auto'" in message
