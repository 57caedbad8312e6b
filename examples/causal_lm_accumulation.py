"""Gradient accumulation for a causal LM on padded sequences of variable length, checked exactly.

    accel launch --num_processes 2 examples/causal_lm_accumulation.py
    python examples/causal_lm_accumulation.py                     # one process

A port of Accelerate's recipe "gradient accumulation for autoregressive models" without
transformers: `iter()` on the loader every epoch, the micro-batches of one optimizer step taken
with `next()` (the last step of an epoch takes what is left), the loss summed over the tokens
the model scores and divided by their global count (`num_items_in_batch(..., shift=True)`: a
causal LM scores `labels[..., 1:]`). Each rank then trains the same initial model alone on every
window's whole global batch and checks that both runs end with the same weights.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

import accel

VOCAB, GLOBAL_MICRO_BATCH = 17, 4


class TinyGPT(nn.Module):
    """A GPT-2-style block: token and position embeddings, causal attention, MLP, LM head."""

    def __init__(self, dim: int = 16, max_len: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(max_len, dim)
        self.ln1, self.attn = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim)
        self.ln2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU())
        self.proj, self.ln_f = nn.Linear(4 * dim, dim), nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        q, k, v = self.attn(self.ln1(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(self.mlp(self.ln2(x)))
        return self.head(self.ln_f(x))


def sequences(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(1, VOCAB, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g)
        for _ in range(n)
    ]


def pad(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad with 0; padded positions get label -100 (ignored, as transformers does)."""
    ids = nn.utils.rnn.pad_sequence(batch, batch_first=True)
    labels = nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=-100)
    return {"input_ids": ids, "labels": labels}


def summed_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM loss, summed over the scored tokens: logits at t predict labels at t + 1."""
    logits = model(batch["input_ids"])[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=24)
    args = parser.parse_args()
    ctx = accel.init_distributed(grad_accum_steps=4, seed=0)
    torch.manual_seed(0)
    model = TinyGPT()
    # trained below in this one process on the whole batches, on the same device as the model
    reference = copy.deepcopy(model).to(ctx.device)
    data = sequences(args.samples)
    batch_size = GLOBAL_MICRO_BATCH // ctx.world_size  # the same global micro-batch at any size
    loader = accel.shard_loader(
        ctx, DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=pad)
    )
    model = accel.wrap_model(ctx, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    steps_per_epoch = math.ceil(len(loader) / ctx.grad_accum_steps)
    for epoch in range(args.epochs):
        iterator = iter(loader)  # as Accelerate's recipe does: a full pass every epoch
        order = list(RandomSampler(data, generator=torch.Generator().manual_seed(ctx.seed + epoch)))
        for step in range(steps_per_epoch):
            left = len(loader) - step * ctx.grad_accum_steps
            window = [next(iterator) for _ in range(min(ctx.grad_accum_steps, left))]
            n = accel.num_items_in_batch(ctx, window, shift=True)  # global count of scored tokens
            for i, batch in enumerate(window):
                with accel.accumulate(ctx, model, i, is_last=i == len(window) - 1):
                    loss = summed_loss(model, batch) * ctx.world_size * ctx.grad_accum_steps / n
                    accel.scaled_backward(ctx, loss)  # divides by grad_accum_steps
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # the reference: this window's whole global batch, one process, one backward
            first = step * ctx.grad_accum_steps * GLOBAL_MICRO_BATCH
            whole = pad([data[j] for j in order[first : first + len(window) * GLOBAL_MICRO_BATCH]])
            whole = {k: v.to(ctx.device) for k, v in whole.items()}
            ref_loss = summed_loss(reference, whole) / (whole["labels"][:, 1:] != -100).sum()
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad(set_to_none=True)
        if ctx.is_main:
            print(f"epoch {epoch} reference loss {ref_loss.item():.4f}", flush=True)
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(accel.unwrap_model(model).parameters(), reference.parameters(), strict=True)
    )
    verdict = "matches" if diff < 1e-5 else "DIFFERS FROM"
    print(
        f"[rank {ctx.rank}] after {args.epochs} epochs the model {verdict} the full-batch "
        f"reference (max diff {diff:.1e})",
        flush=True,
    )
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
