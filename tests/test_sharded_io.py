"""The pure arithmetic of sharded safetensors I/O: which bytes of a file hold a slice."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from accel._safetensors.header import CorruptFileError
from accel.checkpoint._sharded_io import byte_runs, file_entries, merge_runs


def _gather_runs(full: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """Read a slice of `full` the way the loader does: byte runs into a local buffer."""
    data = full.contiguous().view(torch.uint8).reshape(-1)
    local = torch.empty([len(i) for i in indices], dtype=full.dtype)
    out = local.view(torch.uint8).reshape(-1)
    for file_at, local_at, length in merge_runs(byte_runs(list(full.shape), indices, 4)):
        out[local_at : local_at + length] = data[file_at : file_at + length]
    return local


@pytest.mark.parametrize(
    "indices",
    [
        [torch.arange(2, 5), torch.arange(6)],  # rows: one run
        [torch.arange(5), torch.arange(3, 6)],  # columns: one run per row
        [torch.tensor([0, 1, 4]), torch.tensor([1, 2, 5])],  # strided (FSDP2 over TP)
        [torch.arange(0), torch.arange(6)],  # an empty slice (more ranks than rows)
    ],
)
def test_byte_runs_read_exactly_the_slice(indices: list[torch.Tensor]) -> None:
    full = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    expected = full[indices[0]][:, indices[1]]
    assert torch.equal(_gather_runs(full, indices), expected)


def test_rows_are_one_contiguous_run() -> None:
    assert merge_runs(byte_runs([5, 6], [torch.arange(2, 5), torch.arange(6)], 4)) == [(48, 0, 72)]
    assert byte_runs([], [], 2) == [(0, 0, 2)]  # a scalar


def test_the_sharded_loader_reads_headers_through_the_shared_parser(tmp_path: Path) -> None:
    # A header whose offsets do not fit the shape would make a rank read the wrong bytes; the
    # one parser every loader uses refuses it, naming the file and the tensor.
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})
    raw = header.encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(20))
    with pytest.raises(CorruptFileError, match=r"m\.safetensors.*'w' has data_offsets \[0, 20\]"):
        file_entries("load_checkpoint_in_model", [path])
