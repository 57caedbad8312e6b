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


def test_halves_until_the_batch_fits_and_passes_arguments_through() -> None:
    tried: list[int] = []
    run = find_executable_batch_size(_fits_up_to(20, tried), start=128)
    assert run(scale=3) == 16 * 3
    assert tried == [128, 64, 32, 16]


def test_decorator_form_and_cpu_allocator_message() -> None:
    tried: list[int] = []

    @find_executable_batch_size(start=10)
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
    assert tried == [5, 2, 1]
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
