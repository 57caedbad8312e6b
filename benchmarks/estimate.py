"""Memory estimates side by side: accel's per-rank estimate, Accelerate's and DeepSpeed's.

Three models (GPT-2 125M from transformers' default GPT2Config, the 1.2B Llama of
benchmarks/gpu.py, a Llama-3-8B-shaped transformers LlamaConfig), trained in bf16 with AdamW
at sequence 2048 (GPT-2: 1024). For each: `accel.estimate_memory` on one GPU and on 8 GPUs
(FSDP2, each block its own unit), Accelerate's `estimate_training_usage` (what `accelerate
estimate-memory` prints for training, batch size 1, no layout), and DeepSpeed's
`estimate_zero3_model_states_mem_needs` for 8 GPUs without offload (what
`estimate_zero3_model_states_mem_needs_all_live` prints, from the same counts). Then the worked
example of docs/estimate.md: the 1.2B model on 1, 8 and 64 GPUs, with and without FSDP2 and
activation checkpointing. Each estimate's seconds are reported (this machine's CPU). Prints
Markdown; nothing is downloaded.

    python benchmarks/estimate.py               # everything (minutes: the 8B model)
    python benchmarks/estimate.py --only worked  # the worked example
    python benchmarks/estimate.py --only profile # where one estimate's seconds go (8B, 8 ranks)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel
from accel.config import Config
from accel.estimate import gib
from benchmarks.gpu import FULL
from tests.gpu import plumbing


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config())


def llama_8b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, int], str]] = {
    "GPT-2 125M": (gpt2, (1, 1024), "GPT2Block"),
    "Llama 1.2B (benchmarks/gpu.py)": (lambda: plumbing.make_llama(FULL), (1, 2048), "Block"),
    "Llama-3 8B shape": (llama_8b, (1, 2048), "LlamaDecoderLayer"),
}


def fsdp(processes: int, block: str, **keys: Any) -> Config:
    section = {"fsdp_transformer_layer_cls_to_wrap": block, **{f"fsdp_{k}": v for k, v in
                                                              keys.items()}}  # fmt: skip
    return Config(num_processes=processes, distributed_type="FSDP", mixed_precision="bf16",
                  fsdp_config=tuple(section.items()))  # fmt: skip


def timed(
    build: Callable[[], nn.Module], batch: tuple[int, int], config: Config
) -> tuple[Any, float]:
    start = time.perf_counter()
    estimate = accel.estimate_memory(build, batch, config=config)
    return estimate, time.perf_counter() - start


def counts(build: Callable[[], nn.Module]) -> tuple[int, int]:
    """(parameters, the largest module's own parameters), on the meta device."""
    with torch.device("meta"):
        model = build()
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def compare() -> None:
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    print("| model | accel, 1 GPU | accel, 8 GPUs FSDP2 (per rank) | Accelerate (training, "
          "bs 1) | DeepSpeed ZeRO-3, 8 GPUs (per GPU) | accel seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, (build, batch, block) in MODELS.items():
        one, s1 = timed(build, batch, Config(mixed_precision="bf16"))
        eight, s8 = timed(build, batch, fsdp(8, block))
        total, largest = counts(build)
        accelerate = max(estimate_training_usage(total * 4, "bfloat16").values())
        _, deepspeed_gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=8, num_nodes=1, cpu_offload=False
        )
        print(f"| {name} ({total / 1e9:.2f}B), batch {batch[0]}x{batch[1]} | {gib(one.peak)} | "
              f"{gib(eight.peak)} | {gib(accelerate)} | {gib(deepspeed_gpu)} | "
              f"{s1:.1f} / {s8:.1f} |")  # fmt: skip


def worked() -> None:
    build, _, block = MODELS["Llama 1.2B (benchmarks/gpu.py)"]
    batch = (FULL.batch, FULL.seq)
    layouts = {
        "1 GPU": Config(mixed_precision="bf16"),
        "1 GPU, activation checkpointing": fsdp(1, block, activation_checkpointing=True),
        "8 GPUs, DDP": Config(
            num_processes=8, distributed_type="MULTI_GPU", mixed_precision="bf16"
        ),
        "8 GPUs, FSDP2": fsdp(8, block),
        "8 GPUs, FSDP2 + activation checkpointing": fsdp(8, block, activation_checkpointing=True),
        "64 GPUs, FSDP2": fsdp(64, block),
        "64 GPUs, FSDP2 + activation checkpointing": fsdp(64, block, activation_checkpointing=True),
    }
    print(f"\nLlama 1.2B, batch {batch[0]}x{batch[1]} a rank, bf16, AdamW, per rank:\n")
    print("| layout | parameters | gradients | optimizer state | activations | communication "
          "| peak | fits 80 GB | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config in layouts.items():
        try:
            estimate, seconds = timed(build, batch, config)
        except (ValueError, NotImplementedError) as err:
            print(f"| {name} | refused: {err} |||||||")
            continue
        r = estimate.ranks[0]
        sizes = (r.parameters, r.gradients, r.optimizer_state, r.activations, r.communication)
        fits = "yes" if estimate.peak <= 80e9 else "no"
        print(f"| {name} | {' | '.join(gib(s) for s in sizes)} | **{gib(r.peak)}** | {fits} "
              f"| {seconds:.1f} |")  # fmt: skip


# (label, file suffix, function name): cProfile's cumulative seconds of each part of one estimate
_PARTS = (
    ("imports on first use (transformers, torch.distributed.tensor, ...)", "", "<module>"),
    ("the model built on fake tensors", "benchmarks/estimate.py", "llama_8b"),
    ("wrap_model (FSDP2 per block)", "accel/parallel/__init__.py", "wrap_model"),
    ("the optimizer's state (one step over zero gradients)", "accel/estimate/_step.py", "_prime"),
    ("forward and backward", "accel/estimate/_step.py", "forward_backward"),
    ("the optimizer step", "accel/precision.py", "optimizer_step"),
    ("  of which DTensor sharding propagation, not cached", "_sharding_prop.py",
     "propagate_op_sharding_non_cached"),
    ("  of which accel's account (its own time)", "accel/estimate/_account.py",
     "__torch_dispatch__"),
)  # fmt: skip


def profile() -> None:
    """Where the seconds of one estimate go: the 8B model on 8 ranks (FSDP2), the process cold
    as the command's is (imports and torch's caches on first use included)."""
    import cProfile
    import pstats

    build, batch, block = MODELS["Llama-3 8B shape"]
    profiler = cProfile.Profile()
    profiler.enable()
    _, seconds = timed(build, batch, fsdp(8, block))
    profiler.disable()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]

    def cumulative(suffix: str, name: str) -> float:
        found = [v[3] for (file, _, fn), v in stats.items()
                 if fn == name and file.endswith(suffix)]  # fmt: skip
        # <module>: the outermost imports only (nested ones are inside them)
        return max(found, default=0.0) if name == "<module>" else sum(found)

    inner = cumulative("accel/estimate/_fake.py", "__torch_dispatch__")
    print(f"\nOne estimate of the 8B model on 8 ranks (FSDP2): {seconds:.1f} s\n")
    print("| part | seconds | share |")
    print("|---|---|---|")
    for label, suffix, name in _PARTS:
        part = cumulative(suffix, name)
        if name == "__torch_dispatch__":
            part -= inner  # the account's dispatch wraps the fake one: its own time is the rest
        print(f"| {label} | {part:.1f} | {part / seconds:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("compare", "worked", "profile"))
    args = parser.parse_args()
    if args.only in (None, "compare"):
        compare()
    if args.only in (None, "worked"):
        worked()
    if args.only in (None, "profile"):
        profile()


if __name__ == "__main__":
    main()
