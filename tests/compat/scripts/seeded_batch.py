"""Each rank's rows of step `step`'s seeded regression batch (x, y), for the compat scripts that
train a small MLP with mean-squared error (train.py, zero_init.py). Library-neutral."""

from __future__ import annotations

import torch


def seeded_batch(step: int, rank: int, world_size: int, *, micro: int, in_features: int,
                 out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(micro * world_size, in_features, generator=generator)
    y = torch.randn(micro * world_size, out_features, generator=generator)
    rows = slice(rank * micro, (rank + 1) * micro)
    return x[rows], y[rows]
