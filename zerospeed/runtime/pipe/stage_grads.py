"""This stage's gradients at the optimizer step, whatever the ZeRO stage, for the pipeline norm.

The optimizer wrappers own their gradients ([Note: engine / optimizer contract] in
base_optimizer.py). The pipelined engine needs them once per step, to sum the squared norm over
every stage and to clip in place: it sets the wrapper's `global_norm_fn`, which the wrapper's
step calls with the gradients it gathered (`_step_gradients()`, once per step) in place of its
own norm. The tensors are the ones the wrapper then steps with, so scaling them in place is
clipping.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed.runtime.base_optimizer import StepGradients

__all__ = ["StageGradients", "stage_gradients"]


@dataclasses.dataclass
class StageGradients:
    tensors: list[torch.Tensor]
    group: Any = None  # the data-parallel group when each rank holds a disjoint part


def stage_gradients(grads: StepGradients) -> StageGradients:
    return StageGradients(list(grads.tensors), grads.group if grads.partitioned else None)
