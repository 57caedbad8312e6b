from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from accel import RunContext, get_logger, get_rng_state, set_rng_state, set_seed


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_set_seed_makes_every_generator_repeat_and_offsets_by_rank() -> None:
    assert set_seed(5) == 5
    first = _draw()
    set_seed(5)
    assert _draw() == first
    assert set_seed(5, ctx=RunContext(rank=2, world_size=4)) == 7
    assert _draw() != first
    with pytest.raises(ValueError, match="seed=-1 must be a non-negative int"):
        set_seed(-1)


def test_rng_state_round_trip_restores_every_generator() -> None:
    set_seed(1)
    state = get_rng_state()
    first = _draw()
    _draw()
    set_rng_state(state)
    assert _draw() == first
    leaves = [state["python"]["keys"], state["numpy"]["keys"], state["torch"]]
    assert all(isinstance(t, torch.Tensor) for t in leaves)  # storable without pickle


def test_rng_state_restores_from_a_view_as_a_checkpoint_file_gives_it() -> None:
    """A state read back from a file is a view into one storage at an offset, which torch's
    own set_rng_state reads from offset 0 (a wrong state, or a segfault)."""
    set_seed(2)
    state = get_rng_state()
    first = _draw()
    storage = torch.zeros(16 + state["torch"].numel(), dtype=torch.uint8)
    storage[16:] = state["torch"]
    set_rng_state({**state, "torch": storage[16:]})
    assert _draw() == first


def test_logger_records_on_main_only_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accel-test")
    main = get_logger(RunContext(rank=0, world_size=2), "accel-test")
    other = get_logger(RunContext(rank=1, world_size=2), "accel-test")
    main.info("from main %d", 1)
    other.info("hidden")
    other.warning("from rank one", main_process_only=False)
    get_logger(RunContext(), "accel-test").info("single")
    assert [r.getMessage() for r in caplog.records] == [
        "[rank 0] from main 1",
        "[rank 1] from rank one",
        "single",
    ]


def test_get_logger_takes_the_context_first_and_the_old_order_is_deprecated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="accel-old-order")
    ctx = RunContext(rank=1, world_size=2)
    with pytest.warns(DeprecationWarning, match=r"get_logger\(name, ctx\) is deprecated"):
        old = get_logger("accel-old-order", ctx)  # type: ignore[arg-type]
    new = get_logger(ctx, "accel-old-order")
    for log in (old, new):
        log.warning("seen", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] seen", "[rank 1] seen"]
    with pytest.raises(TypeError, match=r"get_logger: name=3 is not a str"):
        get_logger(ctx, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"get_logger: ctx='a' is not a RunContext"):
        get_logger("a", "b")  # type: ignore[arg-type]
