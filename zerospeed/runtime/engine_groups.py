"""The engine's process groups, built once from the run's `ParallelLayout` ([Note: run groups] in
comm/run_groups.py).

One function creates every group of the run, in one order on every rank: AutoTP's data x tensor
grid, or the sequence-parallel grid (from the ds_config or a sequence-parallel mpu), or the
data-parallel group (the world, or the user's mpu: a pipeline's grid is one); then the expert
groups of every MoE ep size, in the model's order. Every size is read from the layout, none from
the config or the model. The groups a `PipelineModule` built at construction (its grid and its tie
groups) are taken into the value as they are. The result is frozen, published
for DeepSpeed's accessors and handed to the features.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.layout import ParallelLayout
from zerospeed.comm.run_groups import AxisGroup, ExpertGroups, RunGroups

__all__ = ["build_run_groups"]


def build_run_groups(layout: ParallelLayout, model: torch.nn.Module, mpu: Any, *,
                     use_data_before_expert_parallel: bool = False) -> RunGroups:
    """Every process group of this run (collective: every rank calls it with the same layout).
    The sizes are the layout's; the model is read for AutoTP's checks and a PipelineModule's tie
    groups, the mpu for the groups it built; `use_data_before_expert_parallel` orders the expert
    groups' ranks (the ds_config's `use_data_before_expert_parallelism`)."""
    from zerospeed.runtime.sequence_parallel.groups_setup import build_sequence_parallel
    from zerospeed.runtime.tensor_parallel.setup import build_tensor_parallel_grid

    tensor = data = None
    if layout.tensor > 1:
        tensor, data = build_tensor_parallel_grid(layout.tensor, model, mpu)
    sp = build_sequence_parallel(layout.sequence, mpu if tensor is None else None)
    sequence = sequence_data = None
    if sp is not None:
        data = _axis(sp.data_parallel_group)
        sequence, sequence_data = _axis(sp.sequence_parallel_group), _axis(sp.sequence_data_parallel_group)
    elif data is None:
        data = groups.initialize_data_parallel(mpu=mpu)
    experts = _expert_groups(layout, use_data_before_expert_parallel)
    pipe, pipe_model = _pipeline_groups(mpu)
    run = RunGroups(layout, data, sequence_data or data, sequence_parallel=sequence, tensor_parallel=tensor,
                    pipe_parallel=pipe, pipe_model_parallel=pipe_model, experts=experts, tied=_tie_groups(model))
    groups.publish_run_groups(run)
    return run


def _axis(group: Any) -> AxisGroup:
    """A group built elsewhere (a sequence-parallel mpu, a pipeline grid), its ranks read back."""
    return AxisGroup(group, tuple(comm.get_global_rank(group, r) for r in range(comm.get_world_size(group))))


def _expert_groups(layout: ParallelLayout, use_data_before_expert_parallel: bool) -> dict[str, ExpertGroups]:
    """The expert groups of every ep size of the layout, in its order (the model's: the same on
    every rank, as group creation needs)."""
    built = (groups.build_expert_groups(size, use_data_before_expert_parallel=use_data_before_expert_parallel)
             for size in layout.expert_sizes)
    return {expert.name: expert for expert in built}


def _pipeline_groups(mpu: Any) -> tuple[AxisGroup | None, AxisGroup | None]:
    """A pipeline grid's pipe group and its pipe x tensor (model-parallel) group; none otherwise."""
    if mpu is None or not hasattr(mpu, "get_pipe_parallel_group"):
        return None, None
    return _axis(mpu.get_pipe_parallel_group()), _axis(mpu.get_model_parallel_group())


def _tie_groups(model: torch.nn.Module) -> dict[str, AxisGroup]:
    """The tie groups a PipelineModule built for its tied layers (the ones holding this rank)."""
    tied = getattr(model, "tied_comms", None)
    if tied is None:
        return {}
    return {key: AxisGroup(tie.group, tuple(tie.ranks)) for key, tie in tied.items()}
