"""`CheckpointContext`: everything the checkpoint code reads of a training run, in one typed value.

The engine builds it in one place (`EngineCheckpointer.context`, runtime/engine_checkpointer.py) at each save and
load, so `checkpoint/` depends on this small record and on the optimizer's checkpoint contract
([Note: checkpoint contract] in checkpoint/contract.py), never on the engine itself.
Counters are the values at the moment it was built; a load writes them back on the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed.checkpoint.contract import OptimizerCheckpointing
from zerospeed.comm.run_groups import RunGroups

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
    """The data-parallel size recorded in the model file: DeepSpeed's `seq_dp_world_size` (sp x dp ranks
    under sequence parallelism, else the data-parallel size of the batch)."""
    mp_rank: int
    """The tensor-parallel rank under AutoTP (DeepSpeed's mp rank in file names), else 0."""
    mp_world_size: int
    tp_shards: dict[str, list[int]] | None
    """Under AutoTP, name -> [dim, fused parts] of every split parameter, which the model file
    records ([Note: AutoTP checkpoint layout]); None without AutoTP."""
    ds_config: dict[str, Any]
    num_experts: list[int]
    """Experts per MoE layer; empty without MoE layers."""
    run_groups: RunGroups
    """The run's process groups ([Note: run groups] in comm/run_groups.py): the MoE files' expert ranks."""
    global_steps: int
    global_samples: int
    skipped_steps: int

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.num_experts)
