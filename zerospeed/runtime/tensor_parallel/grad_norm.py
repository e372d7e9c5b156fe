"""The global gradient norm and overflow flag when parameters are split over tensor-parallel ranks.

[Note: tensor-parallel norm]
The gradient vector of the model is the union of every rank's pieces of the split parameters and
one copy of each replicated parameter (replicated gradients are equal on every tp rank: [Note:
tensor-parallel autograd] in layers.py). So the squared norm is

    sum over tp ranks of |split pieces|^2  +  |replicated|^2 (counted once)

Each rank sums the squares of its split and of its replicated elements separately (over its ZeRO
partition, then over the data-parallel group when gradients are partitioned), and only the split
sum is added up over the tensor-parallel group. Older DeepSpeed counted only tp rank 0's pieces, a
norm off by about sqrt(tp) (fixed in DeepSpeed PR#5411); tests compare the norm with the unsharded
model's and with DeepSpeed 0.19.8's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.grad_utils import sum_of_squares

__all__ = ["NormPiece", "any_across", "tensor_parallel_norm"]

NormPiece = tuple[torch.Tensor, bool]   # (gradient elements, whether they belong to a split parameter)


def tensor_parallel_norm(pieces: list[NormPiece], tp_group: Any, dp_group: Any = None,
                         comm_device: torch.device | None = None) -> float:
    """[Note: tensor-parallel norm]; ``dp_group`` when each rank holds a ZeRO partition of the grads."""
    split = sum_of_squares([t for t, is_split in pieces if is_split]).reshape(1)
    replicated = sum_of_squares([t for t, is_split in pieces if not is_split]).reshape(1)
    device = comm_device or split.device
    both = torch.cat([split.to(device), replicated.to(device)])
    if dp_group is not None and comm.get_world_size(dp_group) > 1:
        comm.all_reduce(both, op=comm.ReduceOp.SUM, group=dp_group)
    split_total = both[:1].clone()
    comm.all_reduce(split_total, op=comm.ReduceOp.SUM, group=tp_group)
    return math.sqrt(float(split_total.item()) + float(both[1].item()))


def any_across(flag: bool, group: Any, device: torch.device | None = None) -> bool:
    """True on every rank of ``group`` when ``flag`` is true on any (a split gradient can overflow
    on one tp rank only; all must then skip the step together)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(value, op=comm.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)
