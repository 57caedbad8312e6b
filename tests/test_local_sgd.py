"""local_sgd's arguments and its one-process behaviour (the 2-rank numerics are in tests/dist)."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import RunContext


def test_one_process_trains_unchanged_and_reports_the_windows() -> None:
    torch.manual_seed(0)
    model, plain = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    plain.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    ends = []
    with accel.local_sgd(RunContext(), model):
        for step in range(5):
            for m, o in zip((model, plain), opts, strict=True):
                m(torch.full((2, 3), float(step))).sum().backward()
                o.step()
                o.zero_grad()
            ends.append(accel.local_sgd_step(RunContext(), model, step=step, every=2))
    assert ends == [accel.should_sync(s, 2) for s in range(5)]
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": 0, "every": 0}, r"local_sgd_step: every=0 must be >= 1"),
        ({"step": -1, "every": 2}, r"local_sgd_step: step=-1 must be >= 0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        accel.local_sgd_step(RunContext(), torch.nn.Linear(1, 1), **kwargs)


def test_a_non_module_is_refused() -> None:
    with (
        pytest.raises(TypeError, match=r"local_sgd: model must be an nn\.Module, got int"),
        accel.local_sgd(RunContext(), 3),  # type: ignore[arg-type]
    ):
        pass
