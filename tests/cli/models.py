"""Model factories for `accel estimate-memory` tests (imported by module path)."""

from __future__ import annotations

import torch


def tied_lm() -> torch.nn.Module:
    """Embedding 100x16 tied to the output head, a 16x32 hidden layer, and a buffer of 8."""
    model = torch.nn.Sequential(
        torch.nn.Embedding(100, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16),
        torch.nn.Linear(16, 100, bias=False),
    )  # fmt: skip
    model[3].weight = model[0].weight
    model.register_buffer("scale", torch.ones(8))
    return model
