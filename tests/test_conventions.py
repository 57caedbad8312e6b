"""The conventions of STYLE.md that code can check: frozen dataclasses, no mutable module
state, annotated public functions, a side-effect-free import."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import types

import pytest

import accel

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(accel.__path__, prefix="accel.") if ".cli" not in m.name
)


def _module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", MODULES)
def test_every_dataclass_is_frozen_and_slotted(name: str) -> None:
    for obj in vars(_module(name)).values():
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == name:
            params = obj.__dataclass_params__  # type: ignore[attr-defined]
            assert params.frozen, f"{name}.{obj.__name__} must be frozen"
            assert hasattr(obj, "__slots__"), f"{name}.{obj.__name__} must use slots=True"


@pytest.mark.parametrize("name", MODULES)
def test_no_mutable_module_state(name: str) -> None:
    for attr, value in vars(_module(name)).items():
        if attr == "__all__" or attr.startswith("__"):
            continue
        assert not isinstance(value, (list, dict, set, bytearray)), (
            f"{name}.{attr} is a mutable {type(value).__name__}; use a tuple, frozenset or "
            "MappingProxyType, or pass the state explicitly"
        )


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_are_annotated_and_documented(name: str) -> None:
    module = _module(name)
    for attr in getattr(module, "__all__", ()):
        obj = getattr(module, attr)
        if not inspect.isfunction(obj):
            continue
        signature = inspect.signature(obj)
        missing = [
            p for p, v in signature.parameters.items() if v.annotation is inspect.Parameter.empty
        ]
        assert not missing, f"{name}.{attr}: parameters {missing} are not annotated"
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}.{attr} return"
        assert obj.__doc__ and "Example" in obj.__doc__, f"{name}.{attr} needs a docstring example"


def test_init_reexports_exactly_the_public_modules() -> None:
    public = set()
    for name in MODULES:
        # accel.testing is its own namespace (accel.testing.run_world), as torch.testing is.
        if not name.rsplit(".", 1)[1].startswith("_") and name != "accel.testing":
            public |= set(getattr(_module(name), "__all__", ()))
    assert set(accel.__all__) == public


def test_import_starts_no_cuda_no_process_group_and_writes_no_environment() -> None:
    probe = (
        "import json, os, sys; before = dict(os.environ); import torch;"
        "import torch.distributed as dist; loaded = set(sys.modules); import accel;"
        "print(json.dumps({'cuda': torch.cuda.is_initialized(), 'pg': dist.is_initialized(),"
        " 'env': dict(os.environ) == before,"
        " 'optional': sorted(m for m in set(sys.modules) - loaded"
        "                    if m.split('.')[0] in ('tqdm', 'tensorboard', 'transformers'))}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"cuda": False, "pg": False, "env": True, "optional": []}
