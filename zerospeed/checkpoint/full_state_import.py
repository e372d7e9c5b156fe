"""Importers: the state dict each wrapper's `load_state_dict` expects, cut from the full representation.

[Note: full layout] (full_state.py) holds every parameter's fp32 master, moments and scalars by
name; here each stage's wrapper gets its own rank's part of it, in its own layout. A wrapper's
`load_full_state` (its side of [Note: checkpoint contract]) calls the importer of its layout, so
the checkpoint code never asks which stage runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.full_state import FullOptimizerState, fragment_bounds
from zerospeed.runtime.zero.param_state import rank_span

if TYPE_CHECKING:
    from zerospeed.runtime.data_parallel import DataParallelOptimizer
    from zerospeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from zerospeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["import_stage0", "import_zero12", "import_zero3"]

ParamNames = dict[torch.nn.Parameter, str]


def _common(current: dict[str, Any], full: FullOptimizerState) -> dict[str, Any]:
    if full.loss_scaler is not None:
        current[C.LOSS_SCALER] = full.loss_scaler
        current["overflow"] = full.overflow
    return current


def _with_hyperparams(param_groups: list[dict[str, Any]], full: FullOptimizerState) -> list[dict[str, Any]]:
    if full.param_groups and len(full.param_groups) != len(param_groups):
        raise ValueError(f"the checkpoint has {len(full.param_groups)} optimizer param groups, "
                         f"this run has {len(param_groups)}")
    return [{**group, **(full.param_groups[i] if full.param_groups else {}), "params": group["params"]}
            for i, group in enumerate(param_groups)]


def import_stage0(wrapper: DataParallelOptimizer, full: FullOptimizerState, param_names: ParamNames,
                  load_optimizer_states: bool) -> None:
    current = _common(wrapper.state_dict(), full)
    torch_state = current[C.OPTIMIZER_STATE_DICT]
    replicated = wrapper.replicated_state(param_names)
    names, trainable = replicated.names, replicated.trainable
    full_names = moe_reshard.full_state_names(param_names)   # experts by global id
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    for group, group_names, group_trainable in zip(torch_state["param_groups"], names, trainable):
        for index, local_name, is_trainable in zip(group["params"], group_names, group_trainable):
            if not is_trainable:
                continue
            name = full_names.get(local_name, local_name)
            masters.append(_require(full.fp32, name).clone())
            if name in full.moments:
                # one tensor per param: torch's Adam increments `step` in place
                state[index] = {**_cloned(full.scalars.get(name, {})),
                                **{k: v.clone() for k, v in full.moments[name].items()}}
    torch_state["state"] = state
    torch_state["param_groups"] = _with_hyperparams(torch_state["param_groups"], full)
    if "fp32_groups" in current:
        current["fp32_groups"] = masters
    else:
        _copy_into_params(param_names, full)
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


@torch.no_grad()
def _copy_into_params(param_names: ParamNames, full: FullOptimizerState) -> None:
    full_names = moe_reshard.full_state_names(param_names)
    for param, name in param_names.items():
        if param.requires_grad:
            param.copy_(_require(full.fp32, full_names[name]))


def _require(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"parameter {name!r} is not in the checkpoint's optimizer state")
    return tensors[name]


def import_zero12(wrapper: DeepSpeedZeroOptimizer, full: FullOptimizerState, param_names: ParamNames,
                  load_optimizer_states: bool) -> None:
    current = _common(wrapper.state_dict(), full)
    base = current[C.BASE_OPTIMIZER_STATE]
    full_names = moe_reshard.full_state_names(param_names)   # experts by global id
    state: dict[int, dict[str, Any]] = {}
    for g, params in enumerate(wrapper.trainable_param_groups()):
        group_names = [param_names[p] for p in params]
        lean = current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g]
        partition_numel = lean.numel() + int(current[C.GROUP_PADDINGS][g])
        offsets = _flat_offsets(params, group_names)
        # an expert group is partitioned over its expert-data-parallel group ([Note: MoE param groups])
        group_start = wrapper.groups[g].dp_rank * partition_numel
        new_lean = torch.zeros_like(lean)
        moments: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for local_name, address in current[C.PARAM_SLICE_MAPPINGS][g].items():
            start, numel = fragment_bounds(address)
            param_start = group_start + start - offsets[local_name]
            name = full_names.get(local_name, local_name)
            new_lean.narrow(0, start, numel).copy_(_require(full.fp32, name).reshape(-1).narrow(0, param_start, numel))
            for key, value in full.moments.get(name, {}).items():
                moment = moments.setdefault(key, torch.zeros(partition_numel, dtype=value.dtype))
                moment.narrow(0, start, numel).copy_(value.reshape(-1).narrow(0, param_start, numel))
            scalars = scalars or _cloned(full.scalars.get(name, {}))
        current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g] = new_lean
        if moments:
            state[base["param_groups"][g]["params"][0]] = {**scalars, **moments}
    base["state"] = state
    base["param_groups"] = _with_hyperparams(base["param_groups"], full)
    current[C.PARTITION_COUNT] = [group.world_size for group in wrapper.groups]
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


def import_zero3(wrapper: DeepSpeedZeroOptimizer_Stage3, full: FullOptimizerState, param_names: ParamNames,
                 load_optimizer_states: bool) -> None:
    """Cut this rank's chunk of every parameter ([Note: full layout]) into its sub-group flats;
    padding stays zero. The wrapper copies the masters into its partitions on load."""
    current = _common(wrapper.state_dict(), full)
    dp_rank, world_size, base = wrapper.dp_rank, wrapper.world_size, current[C.OPTIMIZER_STATE_DICT]
    indices = [index for group in base["param_groups"] for index in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for k, params in enumerate(wrapper.fp16_groups):
        flat = torch.zeros_like(current[C.FP32_FLAT_GROUPS][k])
        moments: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        offset = 0
        for param in params:
            name, world, rank = moe_reshard.import_coords(param, param_names[param], world_size, dp_rank)
            start, real_numel = rank_span(param.zs_state.numel, world, rank)   # experts: [Note: MoE stage-3 reshard]
            flat.narrow(0, offset, real_numel).copy_(_require(full.fp32, name).reshape(-1).narrow(0, start, real_numel))
            for key, value in full.moments.get(name, {}).items():
                moment = moments.setdefault(key, torch.zeros(flat.numel(), dtype=value.dtype))
                moment.narrow(0, offset, real_numel).copy_(value.reshape(-1).narrow(0, start, real_numel))
            scalars = scalars or _cloned(full.scalars.get(name, {}))
            offset += param.partition_numel()
        current[C.FP32_FLAT_GROUPS][k] = flat
        if moments:
            state[indices[k]] = {**scalars, **moments}
    base["state"] = state
    base["param_groups"] = _with_hyperparams(base["param_groups"], full)
    current[C.PARTITION_COUNT] = world_size
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


def _cloned(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}


def _flat_offsets(params: list[torch.nn.Parameter], names: list[str]) -> dict[str, int]:
    offsets, total = {}, 0
    for param, name in zip(params, names):
        offsets[name] = total
        total += param.numel()
    return offsets
