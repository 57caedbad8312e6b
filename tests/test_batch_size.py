from __future__ import annotations

import pytest
import torch

from accel.batch_size import find_executable_batch_size, is_out_of_memory


def _fits_up_to(limit: int, tried: list[int]):  # type: ignore[no-untyped-def]
    def step(batch_size: int, scale: int = 1) -> int:
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    return step


def _accelerates_sizes(start: int, limit: int) -> list[int]:
    # accelerate 1.15, utils/memory.py: `batch_size = int(batch_size * 0.9)` after each OOM.
    sizes = [start]
    while sizes[-1] > limit:
        sizes.append(int(sizes[-1] * 0.9))
    return sizes


def test_shrinks_as_accelerate_does_until_the_batch_fits() -> None:
    # Room for 12 rows: accel used to halve 16 to 8; Accelerate (and now accel) trains at 12.
    tried: list[int] = []
    assert find_executable_batch_size(_fits_up_to(12, tried), start=16)() == 12
    assert tried == [16, 14, 12] == _accelerates_sizes(16, 12)
    # Down to 1 from 60 (24 tries): each retry runs gc.collect(), slow in a big test process.
    for start, limit in [(128, 20), (60, 1), (7, 3)]:
        tried = []
        find_executable_batch_size(_fits_up_to(limit, tried), start=start)()
        assert tried == _accelerates_sizes(start, limit)


def test_factor_one_half_halves_and_passes_arguments_through() -> None:
    tried: list[int] = []
    run = find_executable_batch_size(_fits_up_to(20, tried), start=128, factor=0.5)
    assert run(scale=3) == 16 * 3
    assert tried == [128, 64, 32, 16]


@pytest.mark.parametrize("factor", [0, 1, 1.5, -0.5, True, "0.9"])
def test_bad_factor_names_the_argument(factor: object) -> None:
    with pytest.raises(ValueError, match=r"factor=.* must be a number in \(0, 1\)"):
        find_executable_batch_size(lambda b: b, start=8, factor=factor)  # type: ignore[arg-type]


def test_decorator_form_and_cpu_allocator_message() -> None:
    tried: list[int] = []

    @find_executable_batch_size(start=10, factor=0.5)
    def step(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 3:
            raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 8 GB")
        return batch_size

    assert step() == 2
    assert tried == [10, 5, 2]


def test_other_errors_propagate_at_once() -> None:
    tried: list[int] = []

    def step(batch_size: int) -> None:
        tried.append(batch_size)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        find_executable_batch_size(step, start=8)()
    assert tried == [8]


def test_gives_up_after_batch_size_one() -> None:
    tried: list[int] = []
    with pytest.raises(RuntimeError, match="even batch size 1 ran out of memory") as info:
        find_executable_batch_size(_fits_up_to(0, tried), start=5)()
    assert tried == [5, 4, 3, 2, 1]
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.parametrize("start", [0, -4, 2.5, True])
def test_bad_start_names_the_argument(start: object) -> None:
    with pytest.raises(ValueError, match=r"start=.* must be a positive integer"):
        find_executable_batch_size(lambda b: b, start=start)  # type: ignore[arg-type]


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("index out of range"))
    assert not is_out_of_memory(ValueError("out of memory"))
