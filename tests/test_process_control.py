"""The rank-gated decorators and the ordered blocks on hand-built contexts (no process group).

Their real-process behaviour (barriers, ordering, a raising first rank) is in
tests/dist/test_process_control_dist.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from accel import (
    RunContext,
    local_main_process_first,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
)

# Two machines of two processes each: rank = node_rank * 2 + local_rank.
WORLD = [
    RunContext(rank=r, local_rank=r % 2, world_size=4, local_world_size=2, node_rank=r // 2,
               num_nodes=2)
    for r in range(4)
]  # fmt: skip


def _where(decorate: Callable[[RunContext], Any]) -> list[int]:
    """The ranks on which the decorated function ran (and returned its value)."""
    ran = []
    for ctx in WORLD:

        @decorate(ctx)
        def fn(x: int, *, plus: int) -> int:
            return x + plus

        result = fn(ctx.rank, plus=10)
        if result is not None:
            assert result == ctx.rank + 10
            ran.append(ctx.rank)
    return ran


def test_each_decorator_runs_on_its_ranks_only() -> None:
    assert _where(on_main_process) == [0]
    assert _where(on_local_main_process) == [0, 2]
    assert _where(on_last_process) == [3]
    assert [_where(lambda ctx, k=k: on_process(ctx, k)) for k in range(4)] == [[0], [1], [2], [3]]


def test_decorators_on_one_process_run_everything() -> None:
    one = RunContext()
    assert one.is_main and one.is_local_main and one.is_last
    for decorate in (on_main_process, on_local_main_process, on_last_process):

        @decorate(one)
        def hello() -> str:
            """Say hello."""
            return "hi"

        assert hello() == "hi"
        assert hello.__doc__ == "Say hello." and hello.__name__ == "hello"  # functools.wraps
    assert on_process(one, 0)(lambda: 5)() == 5


def test_is_last_is_the_last_global_rank() -> None:
    assert [ctx.is_last for ctx in WORLD] == [False, False, False, True]


@pytest.mark.parametrize("rank", [-1, 4, True, 1.0, "0"])
def test_on_process_refuses_a_rank_outside_the_world(rank: Any) -> None:
    with pytest.raises(ValueError, match=rf"on_process: rank={rank!r} is not a rank of this run"):
        on_process(WORLD[0], rank)


def test_ordered_blocks_on_one_process_just_run() -> None:
    ran = []
    for block in (main_process_first, local_main_process_first):
        with block(RunContext()):
            ran.append(block.__name__)
    assert ran == ["main_process_first", "local_main_process_first"]
    with pytest.raises(KeyError), local_main_process_first(RunContext()):
        raise KeyError("the body's error comes out unchanged")
