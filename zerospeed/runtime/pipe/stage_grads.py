"""This stage's gradients at the optimizer step, whatever the ZeRO stage, for the pipeline norm.

The optimizer wrappers own their gradients ([Note: engine / optimizer contract] in
base_optimizer.py). The pipelined engine needs them once per step, before the wrapper steps, to
sum the squared norm over every stage and to clip in place. `stage_gradients` asks the wrapper
for them through `_step_gradients()`; the tensors it returns are the ones the wrapper then steps
with, so scaling them in place is clipping.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["StageGradients", "stage_gradients"]


@dataclasses.dataclass
class StageGradients:
    tensors: list[torch.Tensor]
    group: Any = None  # the data-parallel group when each rank holds a disjoint part


def stage_gradients(wrapper: Any) -> StageGradients:
    if hasattr(wrapper, "_step_gradients"):
        grads = wrapper._step_gradients()
        return StageGradients(list(grads.tensors), grads.group)
    # Before the wrappers shared `_step_gradients` (engine rework): their own accessors.
    if hasattr(wrapper, "_gradients"):
        return StageGradients(wrapper._gradients())
    if hasattr(wrapper, "groups") and hasattr(wrapper, "dp_process_group"):
        if wrapper._unreduced:
            wrapper.backward_epilogue(is_boundary=True)
        return StageGradients([g.partition_grad for g in wrapper.groups], wrapper.dp_process_group)
    raise NotImplementedError(f"pipeline parallelism cannot read the gradients of {type(wrapper).__name__}")
