"""Split a batch's sequence over the sequence-parallel (sp) ranks, and join results back.

Under Ulysses sequence parallelism every sp rank of a data-parallel rank takes the same batch
and keeps its slice of the sequence: dimension 1 of every tensor of two or more dimensions,
cut into sp equal parts, in rank order. A dict batch holding "input_ids" gains global
"position_ids" (positions in the whole sequence, so rotary embeddings are right on every
slice), and one holding "labels" gains "shift_labels" (the next-token targets, shifted over the
whole sequence, as transformers' causal LM loss takes them), both before the cut: a slice
cannot shift its own labels, since its last target is the next slice's first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accel._tree import tree_map

IGNORE_INDEX = -100  # transformers' and F.cross_entropy's default for unscored targets


def _complete(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` with global position ids and shifted labels added where it has neither."""
    out = dict(batch)
    ids = out.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and "position_ids" not in out:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out["position_ids"] = positions.expand(ids.shape[0], -1)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and "shift_labels" not in out:
        pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
        out["shift_labels"] = torch.cat([labels[:, 1:], pad], dim=1)
    return out


def split_sequence(batch: Any, rank: int, size: int) -> Any:
    """This sp rank's slice of `batch`: dim 1 of every tensor of 2+ dims, cut in `size`.

    Raises ValueError naming the tensor's shape when `size` does not divide its length.

    Example:
        >>> split_sequence({"input_ids": torch.arange(8).view(2, 4)}, 1, 2)["position_ids"]
        tensor([[2, 3],
                [2, 3]])
    """
    if isinstance(batch, Mapping):
        batch = _complete(batch)

    def cut(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2:
            return leaf
        length = leaf.shape[1]
        if length % size:
            raise ValueError(
                f"shard_loader: a batch tensor of shape {tuple(leaf.shape)} has sequence "
                f"length {length} (dim 1), which sp={size} does not divide; each sp rank holds "
                f"length / sp tokens. Pad or cut sequences to a multiple of {size} (e.g. "
                f"pad_to_multiple_of={size} in the tokenizer's collator)."
            )
        part = length // size
        return leaf[:, rank * part : (rank + 1) * part].contiguous()  # views trip .view()

    return tree_map(cut, batch)
