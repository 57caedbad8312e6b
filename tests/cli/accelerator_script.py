"""An unported Accelerate script: a plain `Accelerator()`, a DDP step and a gather.

Run only as a script (pytest's `--doctest-modules` imports every module under tests/). Each
rank writes `<out>/<rank>.json`: what its Accelerator sees of the world, what a gather returns
and the weights after one step on its half of a fixed batch.
"""

import json
import sys

import torch
from accelerate import Accelerator
from torch import nn


def main(out: str) -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(16.0).reshape(4, 4) / 10
    y = torch.arange(4.0).reshape(4, 1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, size = accelerator.process_index, accelerator.num_processes
    part = slice(rank * 4 // size, (rank + 1) * 4 // size)  # this rank's rows of the batch
    loss = nn.functional.mse_loss(model(x[part].to(accelerator.device)), y[part])
    accelerator.backward(loss)
    optimizer.step()
    gathered = accelerator.gather(torch.tensor([float(rank)], device=accelerator.device))
    weights = accelerator.unwrap_model(model).weight.detach().flatten().tolist()
    report = {
        "num_processes": size,
        "process_index": rank,
        "distributed_type": str(accelerator.distributed_type),
        "gathered": gathered.tolist(),
        "weights": weights,
    }
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
