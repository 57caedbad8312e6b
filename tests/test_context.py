from __future__ import annotations

import dataclasses

import pytest
import torch

from accel import RunContext


def test_fields_and_properties_of_a_hand_built_context() -> None:
    ctx = RunContext(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2
    )
    assert (ctx.is_main, ctx.is_local_main, ctx.is_distributed) == (False, False, True)
    assert RunContext().is_main and not RunContext().is_distributed
    assert RunContext(rank=2, local_rank=0, world_size=4, local_world_size=2).is_local_main


def test_context_is_frozen_and_changed_with_replace() -> None:
    ctx = RunContext(precision="bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.precision = "fp16"  # type: ignore[misc]
    assert dataclasses.replace(ctx, precision="fp16").precision == "fp16"
    assert ctx.precision == "bf16"
    with pytest.raises(TypeError):
        RunContext(0, 0)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rank": 4, "world_size": 4}, r"rank=4 must be in \[0, world_size=4\)"),
        ({"rank": -1}, r"rank=-1 must be in"),
        ({"world_size": 0}, r"world_size=0 must be an int >= 1"),
        ({"local_rank": 2, "local_world_size": 2}, r"local_rank=2"),
        ({"node_rank": 1}, r"node_rank=1"),
        ({"grad_accum_steps": 0}, r"grad_accum_steps=0"),
        ({"grad_accum_steps": True}, r"grad_accum_steps=True"),
        ({"precision": "no"}, r"precision='no' is not supported; expected one of \('fp32'"),
        ({"backend": "ucc"}, r"backend='ucc' is not supported"),
    ],
)
def test_bad_fields_are_rejected_with_the_value_and_the_fix(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunContext(**fields)


def test_validation_reruns_on_replace() -> None:
    with pytest.raises(ValueError, match="rank=5"):
        dataclasses.replace(RunContext(world_size=4), rank=5)


def test_device_strings_are_converted_and_other_types_refused() -> None:
    assert RunContext(device="cpu").device == torch.device("cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"device=3 must be a torch.device"):
        RunContext(device=3)  # type: ignore[arg-type]


def test_single_picks_a_local_device() -> None:
    ctx = RunContext.single(precision="bf16")
    assert ctx.world_size == 1 and ctx.precision == "bf16"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.backends.mps.is_available():
        expected = "mps"
    assert ctx.device.type == expected


def test_describe_lists_every_field_with_its_source() -> None:
    ctx = RunContext(precision="fp16", sources={"precision": "env ACCEL_PRECISION"})
    lines = ctx.describe().splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [f.name for f in dataclasses.fields(RunContext) if f.name != "sources"]
    assert "precision        = 'fp16'  (env ACCEL_PRECISION)" in lines
    assert "rank             = 0  (constructed)" in lines


def test_sources_cannot_be_mutated_through_the_context() -> None:
    given = {"precision": "argument"}
    ctx = RunContext(sources=given)
    given["precision"] = "changed"
    assert ctx.sources["precision"] == "argument"
    with pytest.raises(TypeError):
        ctx.sources["rank"] = "x"  # type: ignore[index]


@pytest.mark.parametrize(
    "name", ["fsdp", "compile", "compile_dynamic", "activation_checkpointing", "deepspeed"]
)
def test_the_old_wrap_fields_are_refused_naming_their_new_spelling(name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name}= is now a field of `wrap`: write wrap=Wrap"):
        RunContext(**{name: None})
    with pytest.raises(TypeError, match=rf"{name}= is now a field of `wrap`"):
        dataclasses.replace(RunContext(), **{name: None})
    with pytest.raises(AttributeError, match=rf"write ctx\.wrap\.{name} "):
        getattr(RunContext(), name)
    assert not hasattr(RunContext(), "no_such_field")


def test_wrap_defaults_are_one_checked_value() -> None:
    from accel import WrapDefaults

    ctx = RunContext(wrap=WrapDefaults(compile="regional", compile_dynamic=False))
    assert (ctx.wrap.compile, ctx.wrap.compile_dynamic, ctx.wrap.fsdp) == ("regional", False, None)
    line = next(s for s in ctx.describe().splitlines() if s.startswith("wrap"))
    assert line.endswith("(constructed)") and "compile='regional'" in line
    with pytest.raises(ValueError, match=r"WrapDefaults: compile='fast' must be False, True"):
        WrapDefaults(compile="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrap=\{\} must be an accel.WrapDefaults"):
        RunContext(wrap={})  # type: ignore[arg-type]
