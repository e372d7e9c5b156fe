"""`RunGroups`: the process groups of one run, built once from its `ParallelLayout` and then frozen.

[Note: run groups]
The engine builds every group a run needs in one place (`runtime/engine_groups.py`), in one order
on every rank, from the run's layout (`comm/layout.py`): the data-parallel group, the
sequence-data-parallel group ZeRO reduces over, the sequence, tensor (AutoTP), pipe and
pipe x tensor groups when those axes exist, and the expert-parallel and expert-data-parallel
groups of every MoE ep size. The value is handed to the features that need groups (AutoTP setup,
the MoE layers, the optimizer factory, which passes it to every wrapper and its gradient space, and
the checkpoint context); nothing changes it afterwards.
An axis the run does not use is None: its size is 1 and this rank's rank on it 0.

DeepSpeed's accessors (`zerospeed.utils.groups`, `comm/groups.py`) stay the way user code and
DeepSpeed's import paths reach the groups: the engine publishes its value into that registry
(`groups.publish_run_groups`), so they read the groups of this value; the same registry still
serves groups user code builds through DeepSpeed's own functions, outside any engine.

This module is pure data: it creates no group and calls no collective.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from zerospeed.comm.layout import ParallelLayout

__all__ = ["AxisGroup", "ExpertGroups", "RunGroups", "expert_group_name_for"]


@dataclasses.dataclass(frozen=True)
class AxisGroup:
    """This rank's process group along one axis, and the global ranks in it."""

    group: Any
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """`global_rank`'s rank inside this group."""
        return self.ranks.index(global_rank)


def expert_group_name_for(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of one ep size (the `group_name` on expert params)."""
    return f"ep_size_{ep_size}"


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """The two groups of one expert-parallel size: the ranks that exchange tokens (each holds other
    experts) and the ranks that hold the same experts (their gradients are reduced there)."""

    ep_size: int
    expert_parallel: AxisGroup
    expert_data_parallel: AxisGroup

    @property
    def name(self) -> str:
        return expert_group_name_for(self.ep_size)


def _frozen_mapping(items: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(items))


@dataclasses.dataclass(frozen=True)
class RunGroups:
    """[Note: run groups]. `data_parallel`: the replicas that see different batches;
    `sequence_data_parallel`: the ranks ZeRO partitions and reduces over (data x sequence; the data
    group itself without sequence parallelism); `pipe_model_parallel`: the ranks of one pipeline
    replica (pipe x tensor), over which the gradient norm of a pipeline is summed."""

    layout: ParallelLayout
    data_parallel: AxisGroup
    sequence_data_parallel: AxisGroup
    sequence_parallel: AxisGroup | None = None
    tensor_parallel: AxisGroup | None = None
    pipe_parallel: AxisGroup | None = None
    pipe_model_parallel: AxisGroup | None = None
    experts: Mapping[str, ExpertGroups] = dataclasses.field(default_factory=dict)
    tied: Mapping[str, AxisGroup] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only views: the value cannot be changed through its mappings either.
        object.__setattr__(self, "experts", _frozen_mapping(self.experts))
        object.__setattr__(self, "tied", _frozen_mapping(self.tied))

    def expert(self, group_name: str) -> ExpertGroups:
        """The groups of the expert group `group_name` ("ep_size_<n>", an expert param's `group_name`)."""
        if group_name not in self.experts:
            raise KeyError(f"this run has no expert group {group_name!r}; its MoE layers use {sorted(self.experts)}")
        return self.experts[group_name]

    @property
    def dp_group(self) -> Any:
        return self.data_parallel.group

    @property
    def tp_group(self) -> Any:
        return None if self.tensor_parallel is None else self.tensor_parallel.group

    @property
    def tp_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.size

    def tp_rank(self, global_rank: int) -> int:
        """This rank's tensor-parallel rank (0 without AutoTP)."""
        return 0 if self.tensor_parallel is None else self.tensor_parallel.rank_of(global_rank)
