"""ZeRO-3's partition padding, written: the same training gives the same bytes.

ZeRO-3 splits each parameter into one partition per rank, padded on the last rank to a multiple
of the world size. DeepSpeed (0.19) allocates a partition with `torch.empty` and copies the
parameter's elements into it, so the padding holds whatever memory it was given; its flat
master copy (the fp32 partitions the optimizer steps) inherits those bytes, the optimizer
carries them through each step, and the engine's state dict, hence a checkpoint, holds them.
When those bytes read as NaN (a recycled allocation, or `torch.use_deterministic_algorithms`,
which fills fresh memory with NaN), two identical runs compare unequal and a checkpoint differs
from run to run. Nothing reads the padding (gathers drop it, the gradients' padding is zeros),
so writing zeros there changes no result.

Torch only: it reads the engine's partition lists, without importing deepspeed.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def clear_zero3_padding(engine: Any) -> None:
    """Write zeros into the padding of a ZeRO-3 engine's partitions: the working (16-bit) ones
    each parameter holds and the fp32 masters. A no-op for ZeRO-1/2 (they pad with zeros) and
    on the ranks that hold no padding."""
    if not engine.zero_optimization_partition_weights():
        return
    optimizer = engine.optimizer
    groups = zip(
        optimizer.fp16_partitioned_groups,
        optimizer.fp32_partitioned_groups_flat,
        optimizer.groups_padding,
        strict=True,
    )
    for partitions, masters, paddings in groups:
        start = 0  # each parameter's partition, padding last, one after another in the masters
        for partition, padding in zip(partitions, paddings, strict=True):
            numel = int(partition.ds_numel)  # its length whether in memory or swapped out
            end = start + numel
            # Partitions and masters swapped out to NVMe are empty tensors here: left as they are.
            if padding and partition.numel() == numel:
                partition[numel - padding :].zero_()
            if padding and masters.numel():
                masters[end - padding : end].zero_()
            start = end
