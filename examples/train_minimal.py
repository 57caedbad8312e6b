"""The whole training loop with every core accel call, on a synthetic regression task.

    accel launch --num_processes 2 examples/train_minimal.py --steps 50
    torchrun --nproc_per_node 2 examples/train_minimal.py --steps 50
    python examples/train_minimal.py                       # one process
    accel launch --num_processes 2 --mixed_precision bf16 --gradient_accumulation_steps 2 \
        examples/train_minimal.py

Runs unchanged on GPUs (one process per GPU, NCCL) and on CPUs (gloo).
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=16, help="per process, per micro-step")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctx = accel.init_distributed(seed=0)  # reads the launcher's environment
    accel.set_seed(ctx.seed, ctx=ctx)
    log = accel.get_logger(ctx, __name__)  # records from the main process only
    log.info(ctx.describe())

    # y = x @ w_true + noise: the loss should fall towards the noise level (0.01).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = x @ torch.randn(32, 1, generator=g) / 32**0.5 + 0.1 * torch.randn(4096, 1, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    model = accel.wrap_model(ctx, model)  # DDP when there are several processes
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after wrapping
    scaler = accel.make_scaler(ctx)  # a GradScaler for fp16, else None

    micro_step, step, epoch = 0, 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            with accel.accumulate(ctx, model, micro_step) as sync:  # no all-reduce until sync
                with accel.autocast(ctx):
                    loss = F.mse_loss(model(xb).float(), yb)
                accel.scaled_backward(ctx, loss, scaler=scaler)  # divides by grad_accum_steps
            micro_step += 1
            if not sync:
                continue
            accel.clip_grad_norm_(ctx, model, 1.0, optimizer=optimizer, scaler=scaler)
            stepped = accel.optimizer_step(ctx, optimizer, scaler=scaler)  # False if skipped
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0 or step == args.steps:
                mean_loss = accel.reduce(ctx, loss.detach(), op="mean")  # same value on all ranks
                log.info(f"step {step} loss {mean_loss.item():.4f} stepped={stepped}")
            if step == args.steps:
                break
        epoch += 1

    accel.wait_for_everyone(ctx)
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
