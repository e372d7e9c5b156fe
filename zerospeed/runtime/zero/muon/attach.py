"""How each ZeRO wrapper tells `MuonWithAuxAdam` where its matrices are ([Note: owner-based Muon]).

Called once by the wrapper after it has laid out its flat buffers (stage 0: its fp32 masters);
does nothing for any other optimizer. The groups an expert parameter's or an AutoTP-split matrix's
owners exchange over come from the run's groups the wrapper was handed ([Note: run groups] in
comm/run_groups.py). A ZeRO 1-3 wrapper built directly through its DeepSpeed-named constructor,
without them, reads the ones the last engine published (`comm/groups.py`), as its partitioning does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from zerospeed.runtime.zero.muon.owner_exchange import OwnerOrthogonalizer, ReplicatedOrthogonalizer
from zerospeed.runtime.zero.muon.owner_plan import flat_partition_specs, per_param_partition_specs
from zerospeed.runtime.zero.muon.tp_matrices import matrix_step_for

__all__ = ["attach_stage0", "attach_zero12", "attach_zero3"]


def attach_stage0(optimizer: torch.optim.Optimizer, dp_group: Any, run_groups: RunGroups | None) -> None:
    """Stage 0: whole parameters on every rank; each Muon group's matrices split among owners."""
    if not isinstance(optimizer, MuonWithAuxAdam):
        return
    for index, group in enumerate(optimizer.param_groups):
        if group["use_muon"]:
            shapes = [tuple(p.shape) for p in group["params"]]
            matrices = matrix_step_for(group["params"], shapes, _tp_group(run_groups))
            owners = _expert_dp_group(group["params"], run_groups) or dp_group
            optimizer.set_group_orthogonalizer(index, ReplicatedOrthogonalizer(shapes, owners, matrices))


def attach_zero12(optimizer: torch.optim.Optimizer, groups: Sequence[Any], run_groups: RunGroups | None) -> None:
    """ZeRO 1/2: one flat group buffer per param group, cut into equal rank partitions."""
    if not isinstance(optimizer, MuonWithAuxAdam):
        return
    for opt_group, group in zip(optimizer.param_groups, groups):
        if not opt_group["use_muon"]:
            continue
        shapes = [tuple(p.shape) for p in group.params]
        specs = flat_partition_specs(shapes, list(group.layout.param_offsets), group.layout.partition_numel,
                                     group.world_size)
        matrices = matrix_step_for(group.params, shapes, _tp_group(run_groups))
        orthogonalizer = OwnerOrthogonalizer(specs, group.process_group, matrices, _compute_device())
        optimizer.set_orthogonalizer(_stepped(opt_group, 1)[0], orthogonalizer)


def attach_zero3(optimizer: torch.optim.Optimizer, group_ranges: Sequence[range], sub_group_params: Sequence[Any],
                 offset_of: Any, dp_group: Any, world_size: int, run_groups: RunGroups | None) -> None:
    """ZeRO 3: one flat buffer per sub-group, every parameter cut into W chunks at the same offset."""
    if not isinstance(optimizer, MuonWithAuxAdam):
        return
    for opt_group, sub_groups in zip(optimizer.param_groups, group_ranges):
        if not opt_group["use_muon"]:
            continue
        masters = _stepped(opt_group, len(sub_groups))
        for master, k in zip(masters, sub_groups):
            params = sub_group_params[k]
            shapes = [tuple(p.ds_shape) for p in params]
            # [Note: MoE at stage 3] experts are partitioned over their expert-data-parallel group.
            group = _expert_dp_group(params, run_groups) or dp_group
            size = world_size if group is dp_group else comm.get_world_size(group)
            specs = per_param_partition_specs(shapes, [offset_of(p) for p in params], size)
            matrices = matrix_step_for(params, shapes, _tp_group(run_groups))
            optimizer.set_orthogonalizer(master, OwnerOrthogonalizer(specs, group, matrices, _compute_device()))


def _stepped(opt_group: dict[str, Any], num_partitions: int) -> list[torch.Tensor]:
    """The tensors the optimizer steps for a Muon group's partitions, one each: the fp32 masters,
    or with `offload_optimizer` its units, one per partition, in host memory or NVMe files
    ([Note: whole-partition units] in offload/offload_states.py)."""
    params = list(opt_group["params"])
    if len(params) != num_partitions:
        raise RuntimeError(f"Muon param group {opt_group.get('name')!r} holds {len(params)} tensors for "
                           f"{num_partitions} partitions: each partition must be stepped whole")
    return params


def _compute_device() -> torch.device:
    """Where the owner exchange and Newton-Schulz run: the accelerator, also for host (offloaded)
    partitions, whose updates travel there and back (the collectives' device)."""
    return torch.device(get_accelerator().current_device_name())


def _tp_group(run_groups: RunGroups | None) -> Any:
    """The tensor-parallel group AutoTP split the matrices over (None without AutoTP): the run's; for
    a wrapper built without them, the published one (module docstring)."""
    if run_groups is not None:
        return run_groups.tp_group
    from zerospeed.comm import groups

    return groups.get_group(groups.MODEL_PARALLEL).group if groups.is_initialized(groups.MODEL_PARALLEL) else None


def _expert_dp_group(params: Sequence[Any], run_groups: RunGroups | None) -> Any:
    """The expert-data-parallel group of a list of MoE expert parameters (DeepSpeed's `allreduce=False`,
    `group_name`): the ranks holding the same experts, which own their matrices; None for dense ones.
    From the run's groups (without them, the published ones: module docstring)."""
    experts = [not getattr(p, "allreduce", True) for p in params]
    if not any(experts):
        return None
    names = {getattr(p, "group_name", None) for p in params}
    if not all(experts) or len(names) != 1:
        raise ValueError("a Muon param group mixes MoE expert parameters with others (or several expert groups): "
                         "build the param groups with zerospeed.moe.utils.split_params_into_different_moe_groups_"
                         "for_optimizer")
    from zerospeed.comm import groups

    return groups.expert_groups(str(names.pop()), run_groups).expert_data_parallel.group
