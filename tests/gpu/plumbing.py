"""What the GPU suite and benchmarks/gpu.py share: sizes, models, reference loops, comparisons.

Every function takes the device it runs on. On a CUDA machine the suite passes cuda:0 and real
sizes; under `--gpu-dry-run` (CI's `make gpu-check DRY_RUN=1`) it passes the CPU and the sizes
shrink, so this code runs on every CI build. Reference loops are plain PyTorch (torch.amp,
`fully_shard`, `checkpoint_wrapper`, `torch.compile`), never accel.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accel
from tests.models import GPT2_124M, Block, GPT2LMHead, Llama, Shape, lm_loss


@dataclass(frozen=True)
class LlamaSizes:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def llama_sizes(device: torch.device) -> LlamaSizes:
    """A small Llama for the correctness tests: real shapes on a GPU, tiny on the CPU."""
    if on_gpu(device):
        return LlamaSizes(vocab=1024, dim=256, heads=8, layers=4, seq=128, batch=8)
    return LlamaSizes(vocab=64, dim=32, heads=4, layers=2, seq=16, batch=4)


def gpt2_shape(device: torch.device) -> Shape:
    """GPT-2 124M on a GPU; the same layout (12 blocks, tied head) at width 64 on the CPU."""
    return GPT2_124M if on_gpu(device) else Shape(vocab=256, dim=64, heads=4, layers=12)


def make_llama(sizes: LlamaSizes, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(vocab=sizes.vocab, dim=sizes.dim, heads=sizes.heads, layers=sizes.layers)


def make_gpt2(shape: Shape, seed: int = 0) -> GPT2LMHead:
    torch.manual_seed(seed)
    return GPT2LMHead(shape)


def tokens(sizes: LlamaSizes, steps: int, seed: int = 1) -> torch.Tensor:
    """(steps, batch, seq + 1) token ids on the CPU: inputs and shifted targets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, sizes.vocab, (steps, sizes.batch, sizes.seq + 1), generator=g)


@contextlib.contextmanager
def one_rank_group(device: torch.device, **fields: Any) -> Iterator[accel.RunContext]:
    """A process group of one rank (nccl on CUDA, gloo on the CPU) and its context."""
    backend = "nccl" if on_gpu(device) else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    extra = {"device_id": device} if on_gpu(device) else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **extra)
    try:
        yield accel.RunContext(rank=0, world_size=1, device=device, backend=backend, **fields)
    finally:
        dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor on the CPU (gathered first when it is a DTensor)."""
    gather = getattr(t, "full_tensor", None)
    return (gather() if callable(gather) else t).detach().cpu().clone()


def assert_same_params(a: nn.Module, b: nn.Module, *, rtol: float = 0, atol: float = 0) -> None:
    """Equal parameters (bit-identical by default), compared by position (wrappers rename)."""
    pa, pb = list(a.parameters()), list(b.parameters())
    assert len(pa) == len(pb)
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        torch.testing.assert_close(full(x), full(y), rtol=rtol, atol=atol, msg=f"parameter {i}")


def reduction_noise(device: torch.device) -> dict[str, float]:
    """Tolerances for two runs of the same kernels: none on the CPU; on CUDA, attention and
    embedding backward add with atomics, so sums may differ in their last bits. A wrong
    compute dtype (bf16 against fp32) moves losses by 1e-4 to 1e-3 relative: still caught."""
    return {"rtol": 1e-5, "atol": 1e-7} if on_gpu(device) else {"rtol": 0, "atol": 0}


def param_noise(device: torch.device) -> dict[str, float]:
    """Parameters after SGD steps on such gradients: lr x the gradients' last-bit noise."""
    return {"rtol": 1e-4, "atol": 1e-6} if on_gpu(device) else {"rtol": 0, "atol": 0}


# ---- precision: an MLP whose every op is deterministic on CUDA (no attention, no atomics) --


def make_mlp(device: torch.device, width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    hidden = 4 * width
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)).to(device)


def mlp_data(width: int, steps: int, *, inf_at: int | None = None) -> list[torch.Tensor]:
    """Per step a (2, 32, width) input/target pair; step `inf_at` holds an inf in its input."""
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(2, 32, width, generator=g) for _ in range(steps)]
    if inf_at is not None:
        data[inf_at][0, 0, 0] = float("inf")
    return data


def amp_by_hand(
    device: torch.device, precision: str, data: list[torch.Tensor], width: int
) -> tuple[nn.Module, list[bool], list[float]]:
    """The torch.amp loop as its documentation writes it: stepped flags and scales per step."""
    model = make_mlp(device, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    stepped, scales = [], []
    for batch in data:
        x, y = batch.to(device)
        with torch.autocast(device.type, dtype=dtype):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepped.append(not scaler.get_scale() < before)
        scales.append(scaler.get_scale())
    return model, stepped, scales


def amp_with_accel(
    device: torch.device, precision: str, data: list[torch.Tensor], width: int
) -> tuple[nn.Module, list[bool], list[float], list[torch.dtype]]:
    """The same loop through accel; also the dtype the first Linear computed in."""
    ctx = accel.RunContext.single(device=device, precision=precision)
    model = accel.wrap_model(ctx, make_mlp(torch.device("cpu"), width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = accel.make_scaler(ctx)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    stepped, scales = [], []
    for batch in data:
        x, y = batch.to(device)
        with accel.autocast(ctx):
            loss = F.mse_loss(model(x), y)
        accel.scaled_backward(ctx, loss, scaler=scaler)
        stepped.append(accel.optimizer_step(ctx, opt, scaler=scaler))
        opt.zero_grad()
        scales.append(scaler.get_scale() if scaler is not None else 1.0)
    return model, stepped, scales, seen


# ---- wrap_model at world size 1: FSDP2 with bf16 mixed precision, checkpointing, compile ---


@dataclass(frozen=True)
class WrapCase:
    ac: bool = False
    compile: bool | str = False


def wrap_by_hand(ctx: accel.RunContext, model: Llama, case: WrapCase) -> nn.Module:
    """Wire what wrap_model does from torch's own calls: AC, regional compile, FSDP2, compile."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(ctx.device)
    for i, block in enumerate(list(model.layers)):
        if case.ac:
            block = checkpoint_wrapper(block)
            model.layers[i] = block
        if case.compile == "regional":
            block.compile()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return torch.compile(model) if case.compile is True else model  # type: ignore[return-value]


def wrap_with_accel(ctx: accel.RunContext, model: Llama, case: WrapCase) -> nn.Module:
    options = accel.FSDPOptions(layer_classes=(Block,), param_dtype=torch.bfloat16)
    return accel.wrap_model(
        ctx,
        model,
        strategy="fsdp2",
        fsdp=options,
        compile=case.compile,
        activation_checkpointing=case.ac,
    )


def train_losses(model: nn.Module, data: torch.Tensor, device: torch.device) -> list[float]:
    """Plain SGD steps on `data`; the losses, read once at the end (no sync per step).

    SGD rather than Adam: Adam's normalised update turns the last-bit noise of a gradient
    near zero (atomic adds in attention and embedding backward on CUDA) into a full step.
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    losses = []
    for batch in data:
        loss = lm_loss(model, batch.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).float().cpu().tolist()


# ---- big models --------------------------------------------------------------------------


def gpu_key(device: torch.device) -> int | str:
    """How a device map names the execution device: 0 for cuda:0, else "cpu"."""
    if not on_gpu(device):
        return "cpu"
    return device.index if device.index is not None else 0


def split_map(device: torch.device, layers: int) -> dict[str, int | str]:
    """Embeddings, the first third of the blocks and the tied head on the execution device,
    the second third on the CPU, the last third on disk."""
    here = gpu_key(device)
    third = layers // 3
    placement: dict[str, int | str] = {
        "transformer.wte": here, "transformer.wpe": here, "lm_head": here,
        "transformer.ln_f": "cpu",
    }  # fmt: skip
    for i in range(layers):
        placement[f"transformer.h.{i}"] = here if i < third else "cpu" if i < 2 * third else "disk"
    return placement


@torch.no_grad()
def greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding without a cache: the prompt and `new_tokens` argmax tokens."""
    ids = prompt
    for _ in range(new_tokens):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


# ---- host syncs --------------------------------------------------------------------------


# What torch's sync debug mode warns with on each synchronizing call (c10/cuda's
# warn_or_error_on_sync). Its first `set_sync_debug_mode` in a process also warns, once, that
# the mode "does not yet detect all synchronizing operations": not a sync, and what the first
# count of a process (gather's, on an H200) counted as one.
SYNC_WARNING = "called a synchronizing CUDA operation"


def syncs_in(messages: list[str]) -> int:
    """How many of `messages` are torch's sync debug mode reporting a synchronizing call."""
    return sum(m.startswith(SYNC_WARNING) for m in messages)


def count_syncs(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """Run `fn`; on CUDA also count its synchronizing calls (torch's sync debug mode).

    Returns fn's result and the count (None on the CPU, where nothing synchronizes).
    """
    if not on_gpu(device):
        return fn(), None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, syncs_in([str(w.message) for w in caught])
