"""A character-level transformer language model, trained on Act I of Coriolanus (in the repo).

    accel launch --num_processes 2 examples/char_lm.py --out runs/lm
    accel launch --num_processes 2 examples/char_lm.py --out runs/lm --resume
    accel launch --num_processes 2 --gradient_accumulation_steps 2 examples/char_lm.py

Each sample is a piece of one speech, so samples have different lengths: the loss is the mean
over every real token of the global batch (`num_items_in_batch`), not a mean of batch means.
Everything the run writes goes under --out: checkpoints/step-N (every --ckpt_every steps, the
newest two kept), metrics.jsonl, loss.csv and the loss curve loss.png (with matplotlib, which the
`demo` and `dev` extras install). A fresh run starts metrics.jsonl anew, so running it twice
draws the same curve; --resume continues from the newest complete checkpoint, adds to the
record, and ends with exactly the losses an uninterrupted run has. At the end rank 0 prints a
sample of generated text. A SIGTERM or SIGUSR1 (a cluster's pre-emption; signal `accel launch`)
stops every rank at the next optimizer step, which is saved; the run ends as its engine reads
"not finished" (the SLURM job is requeued; elsewhere exit code 138) and continues with --resume
(examples/slurm.sbatch and examples/pytorchjob.yaml run it on a cluster).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import accel

TEXT = (Path(__file__).parent / "data" / "coriolanus.txt").read_text()
VOCAB = sorted(set(TEXT))
BLOCK = 64


def speeches(text: str) -> list[torch.Tensor]:
    """Speeches cut into pieces of at most BLOCK + 1 characters, encoded as ids."""
    ids = {c: i for i, c in enumerate(VOCAB)}
    pieces = []
    for speech in text.split("\n\n"):
        encoded = torch.tensor([ids[c] for c in speech + "\n\n"])
        pieces += [p for p in encoded.split(BLOCK + 1) if len(p) > 1]
    return pieces


def collate(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(len(pieces), BLOCK, dtype=torch.long)
    y = torch.full((len(pieces), BLOCK), -100)  # -100: padding, ignored by the loss
    for i, p in enumerate(pieces):
        x[i, : len(p) - 1], y[i, : len(p) - 1] = p[:-1], p[1:]
    return x, y


class CharLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim)
        self.pos = nn.Parameter(torch.zeros(BLOCK, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, len(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(
            self.blocks(self.embed(x) + self.pos[: x.shape[1]], mask=mask, is_causal=True)
        )


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of each sample's real tokens, one value per sample."""
    logits = model(x).float()
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(dim=1)


def generate(model: nn.Module, prompt: str, length: int, device: torch.device) -> str:
    """Sample `length` characters after `prompt` (temperature 0.8, a fixed seed)."""
    ids = {c: i for i, c in enumerate(VOCAB)}
    x = torch.tensor([[ids[c] for c in prompt]], device=device)
    g = torch.Generator(device=device).manual_seed(0)
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            probs = torch.softmax(model(x[:, -BLOCK:])[0, -1].float() / 0.8, dim=-1)
            x = torch.cat([x, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    return "".join(VOCAB[i] for i in x[0].tolist())


def plot_losses(out: Path) -> str:
    """Write loss.csv (and loss.png when matplotlib is installed) from metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # A resumed run logs again the steps after its checkpoint: the last record of a step wins.
    rows = sorted({r["step"]: r for r in rows if "step" in r}.values(), key=lambda r: r["step"])
    (out / "loss.csv").write_text(
        "step,train_loss,val_loss\n"
        + "".join(f"{r['step']},{r['train_loss']},{r.get('val_loss', '')}\n" for r in rows)
    )
    try:
        from matplotlib.figure import Figure  # no pyplot: no window, no global figure state
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no loss.png, see loss.csv"
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="optimizer step", ylabel="loss (nats per character)", title="char_lm")
    ax.legend()
    fig.savefig(out / "loss.png", dpi=100)
    return f"loss curve: {out / 'loss.png'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/char_lm"))
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="per process, per micro-step")
    parser.add_argument("--ckpt_every", type=int, default=25)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    ctx = accel.init_distributed(seed=1234)
    accel.set_seed(ctx.seed or 0, ctx=ctx)
    pieces = speeches(TEXT)
    cut = len(pieces) * 9 // 10
    train = accel.shard_loader(
        ctx, DataLoader(pieces[:cut], args.batch_size, shuffle=True, collate_fn=collate)
    )
    val = accel.shard_loader(ctx, DataLoader(pieces[cut:], 32, collate_fn=collate))

    model = accel.wrap_model(ctx, CharLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 10

    def schedule(s: int) -> float:  # linear warm-up, then cosine decay to zero
        return (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    scaler = accel.make_scaler(ctx)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": train}
    if scaler is not None:
        state["scaler"] = scaler
    if args.resume and (latest := accel.latest_checkpoint(args.out / "checkpoints")) is not None:
        accel.load_state(ctx, latest, **state)
    step = scheduler.last_epoch  # optimizer steps taken so far
    if step == 0 and ctx.is_main:  # a fresh run starts its own record; a resumed one adds to it
        (args.out / "metrics.jsonl").unlink(missing_ok=True)
    tracker = accel.JSONLTracker(args.out / "metrics.jsonl") if ctx.is_main else None
    trackers = [tracker] if tracker is not None else []
    if step == 0:
        accel.log_hparams(
            ctx,
            vars(args) | {"world_size": ctx.world_size, "grad_accum_steps": ctx.grad_accum_steps},
            trackers=trackers,
        )

    def evaluate() -> float:
        model.eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for x, y in val:
                losses = accel.gather_for_metrics(
                    ctx, (token_loss(model, x, y), (y != -100).sum(1)), loader=val
                )
                total, tokens = total + losses[0].sum().item(), tokens + int(losses[1].sum())
        model.train()
        return total / tokens

    with accel.preemption(ctx) as stop:
        window: list[tuple[torch.Tensor, torch.Tensor]] = []
        while step < args.steps:
            for x, y in train:
                window.append((x, y))
                if len(window) < ctx.grad_accum_steps:
                    continue
                # y holds the next characters already: no shift
                n = accel.num_items_in_batch(ctx, [y for _, y in window], shift=False)
                for i, (xb, yb) in enumerate(window):
                    with accel.accumulate(ctx, model, i) as sync:
                        with accel.autocast(ctx):
                            loss_sum = token_loss(model, xb, yb).sum()
                        accel.scaled_backward(
                            ctx, loss_sum * ctx.world_size * ctx.grad_accum_steps / n, scaler=scaler
                        )
                assert sync
                accel.clip_grad_norm_(ctx, model, 1.0, optimizer=optimizer, scaler=scaler)
                accel.optimizer_step(ctx, optimizer, scaler=scaler)
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                window, step = [], step + 1
                train_loss = accel.reduce(
                    ctx, loss_sum.detach() * ctx.world_size * ctx.grad_accum_steps / n, op="mean"
                )
                metrics = {"train_loss": train_loss.item(), "lr": scheduler.get_last_lr()[0]}
                if step % args.eval_every == 0 or step == args.steps:
                    metrics["val_loss"] = evaluate()
                accel.log_metrics(ctx, metrics, step=step, trackers=trackers)
                if ctx.is_main and (step % 10 == 0 or "val_loss" in metrics):
                    print(
                        f"step {step} " + " ".join(f"{k} {v:.6f}" for k, v in metrics.items()),
                        flush=True,
                    )
                # A scheduler's SIGTERM or SIGUSR1 on any rank: every rank stops at this step.
                stopping = stop.requested()
                if step % args.ckpt_every == 0 or step == args.steps or stopping:
                    accel.save_checkpoint(ctx, args.out / "checkpoints", state, step=step, keep=2)
                if stopping:  # leaving the block tells the engine to run the job again
                    if ctx.is_main:
                        print(f"pre-empted at step {step}: saved; rerun with --resume", flush=True)
                    return
                if step == args.steps:
                    break
    if tracker is not None:
        tracker.close()
        print(f"\noutputs in {args.out}/: checkpoints/, metrics.jsonl, loss.csv")
        print(plot_losses(args.out))
        sample = generate(accel.unwrap_model(model), "First Citizen:\n", 200, ctx.device)
        print(f"generated sample:\n{sample}")
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
