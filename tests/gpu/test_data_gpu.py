"""shard_loader with pinned memory and non-blocking copies; gather and gather_for_metrics of
device tensors, and how many host syncs one call makes."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import accel
from tests.gpu import plumbing


def _dataset(device: torch.device) -> TensorDataset:
    rows = 4096 if plumbing.on_gpu(device) else 64  # 4 MB batches on the GPU: copies take time
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(rows * 8, 256, generator=g), torch.arange(rows * 8))


def test_pinned_non_blocking_batches_arrive_whole_and_equal(device: torch.device) -> None:
    data = _dataset(device)
    batch = len(data) // 8
    pin = plumbing.on_gpu(device)  # pinning needs an accelerator
    source = DataLoader(data, batch_size=batch, pin_memory=pin, num_workers=2)
    ctx = accel.RunContext.single(device=device)
    loader = accel.shard_loader(ctx, source, non_blocking=True)
    arrived = []
    for x, i in loader:  # no sync inside the loop: copies overlap and are compared at the end
        arrived.append((x, i, x.sum(dim=1)))
    assert len(arrived) == len(loader) == 8
    for k, (x, i, sums) in enumerate(arrived):
        assert x.device == i.device == device
        expected_x, expected_i = data[k * batch : (k + 1) * batch]
        assert torch.equal(x.cpu(), expected_x)
        assert torch.equal(i.cpu(), expected_i)
        # summed on the device in another order: close, not equal
        torch.testing.assert_close(sums.cpu(), expected_x.sum(dim=1), rtol=1e-4, atol=1e-4)


def test_gather_and_gather_for_metrics_of_device_tensors(device: torch.device) -> None:
    ctx = accel.RunContext.single(device=device)
    loader = accel.shard_loader(ctx, DataLoader(torch.arange(10.0), batch_size=4))
    tree = {"logits": torch.randn(4, 3, device=device), "labels": torch.arange(4, device=device)}
    gathered, gather_syncs = plumbing.count_syncs(device, lambda: accel.gather(ctx, tree))
    assert all(torch.equal(gathered[k], tree[k]) for k in tree)
    metrics = []
    syncs = []
    for batch in loader:
        preds = {"p": batch * 2, "n": batch.long()}
        got, n = plumbing.count_syncs(
            device, lambda p=preds: accel.gather_for_metrics(ctx, p, loader=loader)
        )
        syncs.append(n)
        assert got["p"].device == device
        metrics.append(got)
    assert torch.cat([m["p"] for m in metrics]).cpu().tolist() == [2.0 * i for i in range(10)]
    assert torch.cat([m["n"] for m in metrics]).cpu().tolist() == list(range(10))
    if plumbing.on_gpu(device):  # one process: nothing to exchange, so nothing to wait for
        assert gather_syncs == 0
        assert syncs == [0, 0, 0]
