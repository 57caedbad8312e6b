"""The GPU suite runs where CUDA is present; elsewhere every test is skipped with "needs CUDA".

`pytest tests/gpu --gpu-dry-run` runs the same tests on the CPU at tiny sizes instead (what
`make gpu-check DRY_RUN=1` does in CI), so the suite's plumbing cannot rot before a GPU comes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-dry-run",
        action="store_true",
        help="run tests/gpu on the CPU at tiny sizes: the plumbing, not the GPU",
    )


# Warnings torch itself raises on the paths under test (warnings are errors in this project):
TORCH_WARNINGS = (
    # inductor on an Ampere+ card when float32 matmuls do not use TF32 (the suite's fp32 runs)
    "ignore:TensorFloat32 tensor cores for float32 matrix multiplication:UserWarning",
    # dynamo reads `.grad` of FSDP2's unsharded (non-leaf) parameters while tracing
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning",
    # autograd's device thread calling cuBLAS before it has made the context current
    "ignore:Attempting to run cuBLAS, but there was no current CUDA context:UserWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dry_run = config.getoption("--gpu-dry-run", default=False)
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.cuda)
        for ignored in TORCH_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(ignored))
        if not dry_run and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """cuda:0 on a GPU machine; the CPU under --gpu-dry-run (tiny sizes follow the device)."""
    if torch.cuda.is_available() and not request.config.getoption("--gpu-dry-run"):
        return torch.device("cuda", 0)
    return torch.device("cpu")


# Inductor exports this pointer for the C++ modules it loads (torch/_inductor/codecache.py) and
# never removes it; the variable is read only while a module loads, so it is dropped again
# after each test rather than counted as a leak by tests/conftest.py.
_INDUCTOR_VAR = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


@pytest.fixture(autouse=True)
def _compile_for_this_run(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under --gpu-dry-run, torch.compile uses the aot_eager backend: dynamo and AOTAutograd
    trace exactly as on the GPU, without minutes of C++ builds on a 2-core CI machine."""
    had = _INDUCTOR_VAR in os.environ
    if request.config.getoption("--gpu-dry-run"):
        import torch._dynamo  # only here: importing dynamo costs seconds in every test session

        with torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager"):
            yield
    else:
        yield
    if not had:
        os.environ.pop(_INDUCTOR_VAR, None)
