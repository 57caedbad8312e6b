"""estimate_memory in one process: the fake world's plumbing, the layout read as accel launch
reads it, and bad input refused in one line naming what to change.

Its numbers are checked against measurement in tests/dist/test_estimate_dist.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import accel
from accel.config import Config
from accel.estimate import _plan
from accel.estimate._account import MemoryAccount
from accel.estimate._fake import fake_tensors, fake_world
from accel.estimate._spec import StepSpec
from tests.models import TP_PLAN, Llama


def small() -> nn.Module:
    return Llama(vocab=128, dim=32, heads=4, layers=2)


def test_the_account_counts_live_storages_by_phase_and_keeps_the_peak() -> None:
    account = MemoryAccount()
    with account:
        w = torch.zeros(256)  # setup: a parameter, 1 KiB
        with account.phase_of("forward"):
            a = torch.ones(512)  # 2 KiB of activations
            b = a * 2  # 2 KiB more: the peak
            del a, b
        with account.phase_of("optimizer"):
            s = torch.zeros_like(w)
    assert account.now == {"parameters": 1024, "gradients": 0, "optimizer_state": 1024,
                           "activations": 0, "communication": 0}  # fmt: skip
    assert account.peak_total == 1024 + 4096 and account.peak["activations"] == 4096
    del s


def test_a_fake_world_is_any_rank_of_any_size_and_leaves_nothing_behind() -> None:
    with fake_world(1234, 8192):
        assert (dist.get_rank(), dist.get_world_size()) == (1234, 8192)
        with fake_tensors():
            big = torch.empty(1 << 40)  # a TiB, on fake tensors: no memory
            ids = torch.arange(4)  # integers stay real: code may read them
        assert big.shape == (1 << 40,) and ids.tolist() == [0, 1, 2, 3]
    assert not dist.is_initialized()


@pytest.mark.slow
def test_fsdp2_shards_what_one_process_holds() -> None:
    one = accel.estimate_memory(small, (2, 16), device="cpu")
    four = accel.estimate_memory(
        small, (2, 16), config=Config(num_processes=4, distributed_type="FSDP"), device="cpu"
    )
    assert one.strategy == "none" and four.strategy == "fsdp2"
    assert four.ranks[0].ranks == (0, 1, 2, 3)
    params = sum(p.numel() * 4 for p in small().parameters())
    assert one.ranks[0].parameters == params
    assert four.ranks[0].parameters == pytest.approx(params / 4, rel=0.02)  # padded shards
    assert four.ranks[0].optimizer_state == pytest.approx(2 * params / 4, rel=0.03)
    assert four.peak < one.peak


@pytest.mark.slow
def test_cuda_rounds_each_tensor_to_the_allocators_blocks_and_json_round_trips() -> None:
    cpu = accel.estimate_memory(small, (2, 16), device="cpu")
    cuda = accel.estimate_memory(small, (2, 16), device="cuda")
    assert cuda.peak > cpu.peak and cuda.ranks[0].parameters % 512 == 0
    data = json.loads(json.dumps(cuda.as_dict()))
    assert data["peak"] == cuda.peak
    assert data["ranks"][0]["peak_phase"] in ("forward", "backward", "optimizer")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cuda.ranks = ()  # type: ignore[misc]
    assert "| every rank | 0 |" in cuda.table()


@pytest.mark.slow
def test_tensor_parallel_splits_the_weights() -> None:
    tp = accel.estimate_memory(
        small, (2, 16), config=Config(num_processes=2, parallelism_config=(
            ("parallelism_config_tp_size", 2),)), tp_plan=TP_PLAN, device="cpu",
    )  # fmt: skip
    assert tp.strategy == "tp"
    assert (
        tp.ranks[0].parameters
        < accel.estimate_memory(small, (2, 16), device="cpu").ranks[0].parameters
    )


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (Config(num_processes=6, parallelism_config=(("parallelism_config_tp_size", 4),)),
         r"does not multiply to world_size=6"),
        (Config(num_processes=3, num_machines=2), r"num_processes=3 is not divisible by "
         r"num_machines=2"),
        (Config(num_processes=2, mixed_precision="fp8"), r"fp8.*--mixed_precision bf16"),
        (Config(num_processes=2, distributed_type="DEEPSPEED"),
         r"child process .* pass module-level functions .*not lambdas"),
    ],
)  # fmt: skip
def test_a_layout_that_cannot_work_is_one_line(config: Config, match: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=match) as err:
        accel.estimate_memory(lambda: small(), (2, 16), config=config, device="cpu")
    assert "\n" not in str(err.value)


PP2 = Config(num_processes=2, parallelism_config=(("parallelism_config_pp_size", 2),))


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"microbatches": 3}, r"microbatches=3 does not divide the batch's 2 rows"),
        ({"microbatches": 0}, r"microbatches=0 must be an int >= 1"),
        ({"schedule": "pipedream"}, r"schedule='pipedream' is not supported .*expected one of"),
    ],
)
def test_a_pipeline_that_cannot_run_is_one_line(keywords: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        accel.estimate_memory(small, (2, 16), config=PP2, device="cpu", **keywords)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_pipeline_stages_are_shown_apart_and_the_head_is_named() -> None:
    one = accel.estimate_memory(small, (2, 16), config=PP2, device="cpu")
    assert one.strategy == "pp+none"
    assert [(r.role, r.ranks) for r in one.ranks] == [
        ("pp stage 0", (0,)), ("pp stage 1 (last: the head)", (1,))]  # fmt: skip
    assert all(r.peak_phase == "pipeline" for r in one.ranks)
    # the V schedule: rank 0 holds the first and the last stage (the head), rank 1 the middle
    v = accel.estimate_memory(lambda: Llama(vocab=128, dim=32, heads=4, layers=4), (4, 16),
                              config=PP2, schedule="zbv", microbatches=2, device="cpu")  # fmt: skip
    assert [r.role for r in v.ranks] == ["pp stages 0, 3 (last: the head)", "pp stages 1, 2"]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y[y > 0]  # how many survive depends on the values


class ReadsItsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = float(self.proj.weight.abs().max().item())  # a value: fake tensors have none


@pytest.mark.slow
def test_bad_input_is_one_line_naming_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"could not be built on fake tensors: .*shapes only"):
        accel.estimate_memory(ReadsItsWeights, (4, 8), device="cpu")

    def batch() -> torch.Tensor:
        return torch.randn(4, 8)

    with pytest.raises(ValueError, match=r"reads values from the data \(aten\.") as err:
        accel.estimate_memory(DataDependent, batch, device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"no nn.Embedding to draw them from; pass a callable"):
        accel.estimate_memory(DataDependent, (4, 8), device="cpu")
    with pytest.raises(ValueError, match=r"optimizer='lion' is not one of"):
        accel.estimate_memory(small, (2, 16), optimizer="lion", device="cpu")
    with pytest.raises(ValueError, match=r"device='tpu' is not 'cuda' or 'cpu'"):
        accel.estimate_memory(small, (2, 16), device="tpu")
    with pytest.raises(ValueError, match=r"model='nomodule:x' cannot be loaded"):
        accel.estimate_memory("nomodule:x", (2, 16), device="cpu")


ZERO2 = Config(num_processes=2, distributed_type="DEEPSPEED", deepspeed_config=(("zero_stage", 2),))


# DeepSpeed 0.19's engine, run in this process, calls a collective torch 2.13 deprecates.
@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")
@pytest.mark.slow
def test_a_deepspeed_rank_runs_in_a_child_process_told_its_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = accel.estimate_memory(small, (2, 16), config=ZERO2, device="cpu")
    assert child.strategy == "deepspeed" and child.ranks[0].ranks == (0, 1)
    # DeepSpeed's default reduce bucket, 5e8 elements in fp32: what the run would allocate
    assert child.peak > 5e8 * 4
    # the same rank played in this process, its environment naming it for the while
    layout = _plan.layout(ZERO2)
    with monkeypatch.context() as env:
        for key, value in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 2),
                           ("LOCAL_WORLD_SIZE", 2)):  # fmt: skip
            env.setenv(key, str(value))
        here = _plan.estimate_rank(layout, 0, StepSpec(build=small, batch=(2, 16)), round_to=1)
    assert (child.ranks[0].peak, child.ranks[0].host) == (here.peak, here.host)


@pytest.mark.slow
def test_fsdp2_offload_holds_weights_gradients_and_optimizer_state_in_host_memory() -> None:
    def fsdp(offload: bool) -> Config:
        return Config(num_processes=2, distributed_type="FSDP",
                      fsdp_config=(("fsdp_offload_params", offload),))  # fmt: skip

    on, off = (accel.estimate_memory(small, (2, 16), config=fsdp(o), device="cpu").ranks[0]
               for o in (True, False))  # fmt: skip
    assert off.host == 0 and on.host >= off.parameters + off.optimizer_state
    assert on.parameters == on.gradients == on.optimizer_state == 0
    assert on.peak < off.peak and on.peak == on.activations + on.communication
