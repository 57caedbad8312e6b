"""Shard a small transformer with FSDP2 (fully_shard per block), train it, and checkpoint it.

    accel launch --num_processes 2 examples/fsdp2.py --out runs/fsdp2
    accel launch --num_processes 2 --mixed_precision bf16 examples/fsdp2.py --out runs/fsdp2
    accel launch --num_processes 4 examples/fsdp2.py --out runs/fsdp2 --resume --steps 80

The last command resumes at another world size and trains on to step 80 (`--steps` counts
from the start of the run, so resuming a finished run with the same `--steps` trains nothing,
and says so). Every block is its own FSDP2 unit; parameters and optimizer state are sharded
across ranks.
The training state is saved sharded through torch.distributed.checkpoint, so a run can resume at
another world size; `save_model(..., full_state_dict=True)` writes plain safetensors weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import accel


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One row per token: nn.Linear on a 3-D input returns a view of its 2-D result, and an
        # FSDP2-wrapped module that returns a view draws a warning (in-place ops on it would skip
        # the backward all-gather). The caller reshapes the plain 2-D logits.
        return self.head(self.blocks(self.embed(x)).flatten(0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp2"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    ctx = accel.init_distributed(seed=0)
    accel.set_seed(0, ctx=ctx)
    if ctx.world_size > 1:
        fsdp = accel.FSDPOptions(layer_classes=(Block,))
        model = accel.wrap_model(ctx, Model(), strategy="fsdp2", fsdp=fsdp)
    else:  # one process: nothing to shard; the sharded checkpoint still loads
        model = accel.wrap_model(ctx, Model(), strategy="none")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after wrapping: sharded state
    state = {"model": model, "optimizer": optimizer}
    step = 0
    if args.resume and (latest := accel.latest_checkpoint(args.out / "checkpoints")) is not None:
        step = accel.load_state(ctx, latest, **state)["step"]
        if ctx.is_main:
            print(f"resumed at step {step} from {latest}", flush=True)
            if step >= args.steps:
                print(
                    f"nothing to train: step {step} >= --steps {args.steps} (steps from the "
                    "start of the run); pass a larger --steps to train on",
                    flush=True,
                )

    # A copying task: predict the token seen 3 positions earlier.
    g = torch.Generator().manual_seed(1000 * ctx.rank + step)
    while step < args.steps:
        x = torch.randint(0, 64, (8, 32), generator=g).to(ctx.device)
        with accel.autocast(ctx):
            logits = model(x).unflatten(0, x.shape)  # (batch, time, vocab)
        loss = F.cross_entropy(logits[:, 3:].float().flatten(0, 1), x[:, :-3].flatten())
        accel.scaled_backward(ctx, loss)
        norm = accel.clip_grad_norm_(ctx, model, 1.0)  # the global norm over all shards
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
        step += 1
        if step % 10 == 0:
            mean = accel.reduce(ctx, loss.detach(), op="mean").item()
            if ctx.is_main:
                print(f"step {step} loss {mean:.4f} grad_norm {norm.item():.3f}", flush=True)
            accel.save_checkpoint(ctx, args.out / "checkpoints", state, step=step, keep=1)
    accel.save_model(ctx, model, args.out / "model", full_state_dict=True)
    if ctx.is_main:
        print(f"saved {sorted(p.name for p in (args.out / 'model').iterdir())}")
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
