"""One vocabulary for dtypes: every public argument that takes a dtype takes the same spellings
("bf16", "bfloat16", "torch.bfloat16", torch.bfloat16) through one parser, and refuses the same
bad values with one message naming the function, the argument and the value."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import accel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _dispatched(dtype: Any, folder: Path) -> Any:
    save_file(_model().state_dict(), str(folder / "model.safetensors"))
    with accel.init_empty_weights():
        empty = _model()
    model = accel.dispatch_checkpoint(empty, folder, device_map={"": "cpu"}, dtype=dtype)
    return {n: (p.dtype, p.float()) for n, p in model.state_dict().items()}


# (function, argument) -> what the call gives for a dtype; a folder for the ones that write.
TARGETS: dict[tuple[str, str], Callable[[Any, Path], Any]] = {
    ("FSDPOptions", "param_dtype"): lambda d, _: accel.FSDPOptions(param_dtype=d).param_dtype,
    ("FSDPOptions", "reduce_dtype"): lambda d, _: accel.FSDPOptions(reduce_dtype=d).reduce_dtype,
    ("compute_module_sizes", "dtype"): lambda d, _: accel.compute_module_sizes(_model(), dtype=d),
    ("infer_device_map", "dtype"): lambda d, _: accel.infer_device_map(
        _model(), max_memory={0: 50, "cpu": 50}, dtype=d
    ),
    ("dispatch_checkpoint", "dtype"): _dispatched,
    ("describe_device_map", "dtype"): lambda d, _: accel.describe_device_map(
        _model(), device_map={"": "cpu"}, max_memory={"cpu": 1000}, dtype=d
    ),
}
FLOATING_ONLY = {("FSDPOptions", "param_dtype"), ("FSDPOptions", "reduce_dtype"),
                 ("dispatch_checkpoint", "dtype")}  # fmt: skip


def test_the_targets_are_every_public_argument_that_takes_a_dtype() -> None:
    found = set()
    for name in accel.__all__:
        obj = getattr(accel, name)
        if callable(obj):
            for param in inspect.signature(obj).parameters:
                if param == "dtype" or param.endswith("_dtype"):
                    found.add((name, param))
    assert found == set(TARGETS)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", torch.bfloat16])
@pytest.mark.parametrize("target", list(TARGETS), ids="{0[0]}.{0[1]}".format)
def test_every_dtype_argument_takes_every_spelling_of_bfloat16(
    tmp_path: Path, target: tuple[str, str], spelling: Any
) -> None:
    call = TARGETS[target]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = call(spelling, tmp_path / "a")
    want = call(torch.bfloat16, tmp_path / "b")
    assert got == want if not isinstance(got, dict) else _same(got, want)
    if target[0] == "FSDPOptions":
        assert got is torch.bfloat16


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def norm(v: Any) -> Any:
        return (v[0], v[1].tolist()) if isinstance(v, tuple) else v

    return {k: norm(v) for k, v in a.items()} == {k: norm(v) for k, v in b.items()}


@pytest.mark.parametrize(
    ("value", "error", "problem"),
    [
        ("bfloat17", ValueError, "names no torch dtype"),
        ("cuda", ValueError, "names no torch dtype"),
        (3, TypeError, "is not a (floating )?dtype"),
        (torch.int32, ValueError, "is not a floating dtype"),
        ("int8", ValueError, "is not a floating dtype"),
    ],
)
@pytest.mark.parametrize("target", list(TARGETS), ids="{0[0]}.{0[1]}".format)
def test_a_bad_dtype_gets_one_clear_error_naming_the_argument(
    tmp_path: Path, target: tuple[str, str], value: Any, error: type, problem: str
) -> None:
    fn, arg = target
    real = value if isinstance(value, torch.dtype) else {"int8": torch.int8}.get(value)
    if real is not None and target not in FLOATING_ONLY:  # sizes at any dtype (int8: quantized)
        assert TARGETS[target](value, tmp_path) == TARGETS[target](real, tmp_path)
        return
    pattern = rf"^{fn}: {arg}={re.escape(repr(value))} {problem}; expected .*torch\.bfloat16"
    with pytest.raises(error, match=pattern):
        TARGETS[target](value, tmp_path)
