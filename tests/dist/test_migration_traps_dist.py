"""The migration traps docs/migration.md lists, shown against Accelerate 1.15 itself in one
2-process world (Accelerate on the CPU, on the process group run_world made), so the page
cannot drift from what either library does:

- `accelerator.reduce(t)` sums; `accel.reduce(ctx, t)` means; the literal port is `op="sum"`.
- `accelerator.mixed_precision` says "no" where `ctx.precision` says "fp32".
- `len()` of Accelerate's `skip_first_batches` loader counts the batches left; a resumed
  `ShardedLoader`'s `len()` counts the whole epoch, and `loader.position` the batches done.
- A folder from Accelerate's `save_state` given to `accel.load_state` is recognised, and its
  `model.safetensors` loads with `accel.load_checkpoint_in_model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import RunContext
from accel.testing import run_world
from tests.dist.test_script_lines_dist import _accelerator


def _traps(ctx: RunContext, folder: str) -> dict[str, Any]:
    accelerator = _accelerator(ctx)  # mixed_precision defaults to "no"
    res: dict[str, Any] = {}
    value = torch.tensor([1.0 + ctx.rank, 10.0])
    res["accelerate_reduce"] = accelerator.reduce(value.clone()).tolist()
    res["accel_reduce"] = accel.reduce(ctx, value).tolist()
    res["accel_reduce_sum"] = accel.reduce(ctx, value, op="sum").tolist()
    res["precisions"] = (accelerator.mixed_precision, ctx.precision)
    res["literal_port"] = (accelerator.mixed_precision != "no", ctx.precision != "no")

    # len() after a resume three batches into the epoch (20 samples, batches of 2, 2 ranks: 5)
    data = DataLoader(list(range(20)), batch_size=2)
    skipped = accelerator.skip_first_batches(accelerator.prepare(data), 3)
    res["accelerate_len"] = (len(skipped), len([b for b in skipped]))
    loader = accel.shard_loader(ctx, data)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    resumed = accel.shard_loader(ctx, data)
    resumed.load_state_dict(state)
    left = len(resumed) - resumed.position
    res["accel_len"] = (len(resumed), left, len([b for b in resumed]))

    # Accelerate's save_state folder, then accel.load_state and load_checkpoint_in_model
    torch.manual_seed(3)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()
    fresh = torch.nn.Linear(3, 2)
    try:
        accel.load_state(ctx, folder, model=fresh)
    except FileNotFoundError as err:
        res["load_state_error"] = str(err)
    accel.load_checkpoint_in_model(fresh, str(Path(folder) / "model.safetensors"))
    res["weights_equal"] = torch.equal(fresh.weight, accelerator.unwrap_model(model).weight)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    saved = torch.load(Path(folder) / "optimizer.bin", weights_only=True)
    fresh_optimizer.load_state_dict(saved)
    res["optimizer_step"] = fresh_optimizer.state_dict()["state"][0]["step"].item()
    return res


@pytest.fixture(scope="module")
def traps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = str(tmp_path_factory.mktemp("accelerate_state"))
    return run_world(_traps, world_size=2, timeout=240, args=(folder,))


@pytest.mark.dist
@pytest.mark.slow
def test_reduce_default_sums_in_accelerate_and_means_in_accel(traps: list[dict]) -> None:
    for res in traps:
        assert res["accelerate_reduce"] == [3.0, 20.0] == res["accel_reduce_sum"]
        assert res["accel_reduce"] == [1.5, 10.0]


@pytest.mark.dist
@pytest.mark.slow
def test_precision_says_fp32_where_accelerate_says_no(traps: list[dict]) -> None:
    for res in traps:
        assert res["precisions"] == ("no", "fp32")
        assert res["literal_port"] == (False, True)  # `!= "no"` is always true in accel


@pytest.mark.dist
@pytest.mark.slow
def test_len_after_a_mid_epoch_resume(traps: list[dict]) -> None:
    for res in traps:
        assert res["accelerate_len"] == (2, 2)  # the batches left
        assert res["accel_len"] == (5, 2, 2)  # the whole epoch; len - position is what is left


@pytest.mark.dist
@pytest.mark.slow
def test_an_accelerate_save_state_folder_is_recognised(traps: list[dict]) -> None:
    for res in traps:
        message = res["load_state_error"]
        assert "written by Accelerate's save_state" in message
        assert "random_states_0.pkl" in message and "optimizer.bin" in message
        assert "accel.load_checkpoint_in_model(model, " in message
        assert "/model.safetensors'" in message
        assert res["weights_equal"] and res["optimizer_step"] == 1.0
