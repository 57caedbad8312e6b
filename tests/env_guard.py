"""Which environment variables a test may leave changed: tests/conftest.py's guard asks here.

A test (or accel) that sets a variable and leaves it set leaks it into every later test. Torch
itself, though, writes some variables once per process, the first time it needs them, and only
where they are absent; those are not a leak of the test that happened to need them first.
"""

from __future__ import annotations

from collections.abc import Mapping

# Written by torch only where absent, once per process, and read again later by torch's own
# compile workers (subprocesses inherit the environment), so they are left in place:
SET_BY_TORCH = frozenset(
    {
        # importing torch._dynamo runs torch._inductor's `cache_dir()` (runtime/cache_dir_utils.py)
        "TORCHINDUCTOR_CACHE_DIR",
        # the first Triton kernel inductor builds (runtime/triton_heuristics.py,
        # CachingAutotuner.__init__)
        "TRITON_CACHE_DIR",
        # the first compile, when torch ships its own ptxas or libdevice
        # (runtime/compile_tasks.py, _set_triton_ptxas_path / _set_triton_libdevice_path_impl)
        "TRITON_PTXAS_PATH",
        "TRITON_LIBDEVICE_PATH",
    }
)

# Written on import by deepspeed (`os.environ.setdefault` in deepspeed/__init__.py), which
# transformers imports when it is installed: a library's once-per-process setting, as above.
SET_BY_DEEPSPEED = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK"})

PYTEST_OWN = frozenset({"PYTEST_CURRENT_TEST"})


def leaked(before: Mapping[str, str], after: Mapping[str, str]) -> set[str]:
    """The variables that differ between `before` and `after` and are a test's doing: all but
    pytest's own and those in SET_BY_TORCH or SET_BY_DEEPSPEED that were absent before (a
    value the guard saw and a test changed is still a leak)."""
    return {
        k
        for k in before.keys() | after.keys()
        if before.get(k) != after.get(k)
        and k not in PYTEST_OWN
        and not (k in SET_BY_TORCH | SET_BY_DEEPSPEED and k not in before)
    }
