"""Run a model that does not fit the memory budget: part of it on CPU, the rest offloaded to disk.

    accel launch --num_processes 2 examples/big_model_inference.py --out runs/big
    python examples/big_model_inference.py --out runs/big --cpu_mb 20

The first run writes a "pretrained" checkpoint (sharded safetensors, the Hugging Face layout).
The model is then built on the meta device (no memory), planned against a CPU budget with
`infer_device_map`, and loaded shard by shard with `dispatch_checkpoint`: blocks past the budget
stay on disk and are read for their forward only. Each process runs its own copy on its share of
the prompts (`split_between_processes`). The outputs are checked against the fully loaded model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import accel


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def build(dim: int = 256, depth: int = 12) -> nn.Module:
    # 2.1 MB per block in fp32, 25 MB in all
    return nn.Sequential(*[Block(dim) for _ in range(depth)])


def write_checkpoint(folder: Path) -> None:
    """Two safetensors shards and an index, as a model hub would serve them."""
    torch.manual_seed(0)
    state = build().state_dict()
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/big_model"))
    parser.add_argument("--cpu_mb", type=int, default=12, help="CPU budget for weights, in MB")
    args = parser.parse_args()

    ctx = accel.init_distributed()
    checkpoint = args.out / "checkpoint"
    with accel.main_process_first(ctx):  # rank 0 writes it once; the others wait, then read
        if ctx.is_main and not (checkpoint / "model.safetensors.index.json").exists():
            write_checkpoint(checkpoint)

    with accel.init_empty_weights():
        model = build()
    budget = {"cpu": args.cpu_mb * 2**20, "disk": 2**40}
    device_map = accel.infer_device_map(model, max_memory=budget, no_split=[Block])
    model = accel.dispatch_checkpoint(
        model, checkpoint, device_map=device_map, offload_dir=args.out / f"offload-{ctx.rank}"
    )
    on_disk = sorted(int(k) for k, v in device_map.items() if v == "disk")
    on_cpu = sorted(int(k) for k, v in device_map.items() if v == "cpu")
    print(f"[rank {ctx.rank}] blocks on cpu: {on_cpu}, on disk: {on_disk}")

    prompts = accel.split_between_processes(ctx, list(range(8)))
    x = torch.stack(
        [torch.randn(16, 256, generator=torch.Generator().manual_seed(p)) for p in prompts]
    )
    with torch.no_grad():
        y = model(x)
        torch.manual_seed(0)
        reference = build()  # the whole model in memory, for the check only
        state = {}
        for shard in sorted(checkpoint.glob("*.safetensors")):
            state |= load_file(str(shard))
        reference.load_state_dict(state)
        assert torch.equal(y, reference(x)), "dispatched outputs differ from the loaded model"
    print(f"[rank {ctx.rank}] prompts {prompts}: outputs equal the fully loaded model")
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
