"""notebook_launch in a real Jupyter kernel, and its checks in this process.

tests/notebooks/notebook_launch.ipynb is executed cell by cell through nbclient and ipykernel,
with a kernel running this interpreter (so the venv's accel), exactly as a user's notebook is.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel import RunContext, notebook_launch

NOTEBOOKS = Path(__file__).parent / "notebooks"


def _execute(notebook: Path, workdir: Path) -> list[str]:
    """Run every cell in a fresh kernel of this interpreter; return each code cell's stdout."""
    import nbclient
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    # A kernelspec of our own, naming this interpreter: a "python3" kernel installed on the
    # machine could be another Python without accel.
    spec_dir = workdir / "kernels" / "accel-test"
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "accel test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    manager = AsyncKernelManager(kernel_name="accel-test", kernel_spec_manager=specs)
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=manager, timeout=300, resources={"metadata": {"path": str(workdir)}}
    )
    client.execute(cleanup_kc=True)  # the kernel is ours: shut it down, close its sockets
    return [
        "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
        for cell in nb.cells
        if cell.cell_type == "code"
    ]


def _reference_weight(num_steps: int) -> list[float]:
    # One process on the whole batch: DDP's average of the two halves' mean-loss gradients is
    # the gradient of the mean loss over all 8 rows.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.arange(32.0).reshape(8, 4) / 32
    for _ in range(num_steps):
        model(data).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [round(w, 6) for w in model.weight.detach().flatten().tolist()]


@pytest.mark.slow
@pytest.mark.dist
def test_a_notebook_trains_a_cell_defined_function_on_two_processes(tmp_path: Path) -> None:
    _, _, launch, failure = _execute(NOTEBOOKS / "notebook_launch.ipynb", tmp_path)
    results = [ast.literal_eval(line) for line in launch.splitlines()]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["weight"] for r in results] == [_reference_weight(3)] * 2
    assert results[0]["loss"] != results[1]["loss"]  # each rank's own half of the batch
    # The rank's exception, of a class defined in a cell, comes back whole with its traceback.
    assert failure.startswith("caught StopHere rank 1 stops\nrank 1 of 2 raised:\nTraceback")
    assert 'raise StopHere(f"rank {ctx.rank} stops")' in failure


@pytest.mark.slow
@pytest.mark.dist
def test_run_world_says_plainly_that_it_cannot_spawn_a_cell_defined_function(
    tmp_path: Path,
) -> None:
    # run_world spawns, and a spawned process cannot import a function from the kernel's
    # __main__; it used to fail with "rank 0 exited with code 1 without raising a Python
    # exception (killed, or a crash in native code)".
    *_, spawned = _execute(NOTEBOOKS / "run_world_cell.ipynb", tmp_path)
    assert spawned.startswith(
        "ValueError: run_world: fn='rank_sum' is defined in an interactive session (a notebook "
        "cell), which spawned processes cannot import; move it into a module, or run it with "
        "accel.notebook_launch(fn, ...), which forks."
    ), spawned


def _rank_and_call(ctx: RunContext, make: Any = None) -> tuple[int, int, str, Any]:
    return ctx.rank, ctx.world_size, ctx.device.type, make() if make else None


@pytest.mark.dist
def test_notebook_launch_forks_and_returns_rank_ordered_results() -> None:
    # A lambda does not pickle: the children inherit the arguments by fork.
    results = notebook_launch(_rank_and_call, lambda: 7, num_processes=2, device="cpu", timeout=60)
    assert results == [(0, 2, "cpu", 7), (1, 2, "cpu", 7)]


# In a fresh interpreter, as a notebook kernel is: this test process has imported much more.
DDP_LAUNCH = """
import sys
import torch, accel

def fn(ctx):
    before = set(sys.modules)
    model = accel.wrap_model(ctx, torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    return sorted(m for m in set(sys.modules) - before if m.startswith(HEAVY))

# What DDP's constructor imports, through torch._dynamo: seconds of imports per process.
HEAVY = ("torch._dynamo", "torch.distributed.fsdp", "torch._inductor", "sympy")
print(accel.notebook_launch(fn, num_processes=2, device="cpu", timeout=240))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_a_ddp_launch_imports_no_fsdp_or_dynamo_in_the_ranks() -> None:
    # DDP's constructor imports torch._dynamo, which imports torch.distributed.fsdp: 1.5 s of
    # CPU per rank, the whole of a launch's 5.5 to 6.3 s (on 2 cores) when each forked rank paid
    # it. notebook_launch imports it once in the kernel, so the ranks inherit it.
    run = subprocess.run(
        [sys.executable, "-c", DDP_LAUNCH], capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr
    imported = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert imported == [[], []], "modules each rank imported in wrap_model and its first step"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_processes": 0}, r"notebook_launch: num_processes=0 must be an int >= 1"),
        ({"timeout": float("inf")}, r"notebook_launch: timeout=inf must be a positive number"),
        ({"device": "tpu"}, r"notebook_launch: device='tpu' is not supported"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        notebook_launch(_rank_and_call, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_with_more_processes_than_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"num_processes=2 needs one GPU each but 0 are visible"):
        notebook_launch(_rank_and_call, num_processes=2, device="cuda")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_cuda_initialised_before_the_launch_is_refused_by_name() -> None:
    # In a fresh interpreter: initialising CUDA here would poison every later fork of pytest.
    code = (
        "import torch, accel\n"
        "torch.zeros(1, device='cuda')\n"
        "accel.notebook_launch(lambda ctx: ctx.rank, num_processes=1)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert (
        "RuntimeError: notebook_launch: CUDA is already initialised in this process" in run.stderr
    )


@pytest.mark.cuda
@pytest.mark.dist
@needs_cuda
def test_one_process_per_gpu_over_nccl() -> None:
    num_gpus = min(torch.cuda.device_count(), 2)
    results = notebook_launch(_rank_and_call, num_processes=num_gpus, timeout=300)
    assert results == [(r, num_gpus, "cuda", None) for r in range(num_gpus)]
    assert not torch.cuda.is_initialized()  # the parent never touched CUDA
