"""`CheckpointContext`: everything the checkpoint code reads of a training run, in one typed value.

The engine builds it in one place (`EngineCheckpointing._checkpoint_context`) at each save and
load, so `checkpoint/` depends on this small record and on the optimizer's checkpoint contract
([Note: checkpoint contract] in runtime/optimizer_checkpointing.py), never on the engine itself.
Counters are the values at the moment it was built; a load writes them back on the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed.runtime.optimizer_checkpointing import OptimizerCheckpointing

__all__ = ["CheckpointContext"]


@dataclasses.dataclass(frozen=True)
class CheckpointContext:
    module: torch.nn.Module
    optimizer: OptimizerCheckpointing
    """The engine's wrapper, or `NoOptimizer` when it has none."""
    lr_scheduler: Any
    param_names: dict[torch.nn.Parameter, str]
    dp_rank: int
    dp_world_size: int
    """The data-parallel size of the batch (DeepSpeed's `dp_world_size`), recorded in the model file."""
    mp_rank: int
    """The tensor-parallel rank under AutoTP (DeepSpeed's mp rank in file names), else 0."""
    mp_world_size: int
    tensor_parallel: bool
    """AutoTP is on: the model file records how each parameter was sharded."""
    ds_config: dict[str, Any]
    num_experts: list[int]
    """Experts per MoE layer; empty without MoE layers."""
    global_steps: int
    global_samples: int
    skipped_steps: int

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.num_experts)
