"""`Zero12Checkpointing`: what a ZeRO 1/2 wrapper saves and loads (DeepSpeed's `DeepSpeedZeroOptimizer.state_dict` / `load_state_dict`).

A mixin of `DeepSpeedZeroOptimizer` (stage_1_and_2.py), which owns every tensor named here: its
side of [Note: checkpoint contract] (checkpoint/contract.py). Each dp rank writes one optim file
holding, per param group, this rank's fp32 master partition without its padding, the base
optimizer's state for it and `param_slice_mappings` (where each parameter's fragment lies), which
zero_to_fp32 and a resharded load (`load_full_state`) read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.contract import CheckpointFiles, CheckpointLayout, FrozenParamRecords, frozen_param_records
from zerospeed.checkpoint.full_state import fragment_bounds
from zerospeed.checkpoint.full_state_import import cloned, flat_offsets, require, with_hyperparams, with_loss_scaler
from zerospeed.checkpoint.layout import model_states_name, optim_states_name
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.offload.group_placement import GroupPlacement
from zerospeed.version import __version__

if TYPE_CHECKING:
    from zerospeed.checkpoint.full_state import FullOptimizerState
    from zerospeed.comm.run_groups import RunGroups

__all__ = ["Zero12Checkpointing"]

class Zero12Checkpointing:
    """checkpoint_files / state_dict / load_state_dict / load_full_state of ZeRO stages 1 and 2."""

    optimizer: torch.optim.Optimizer
    precision: PrecisionSettings
    loss_scaler: LossScaler
    overflow: bool
    clip_grad: float
    zero_stage: int
    dp_world_size: int
    groups: list[Any]                             # the wrapper's _FlatGroup per param group
    run_groups: RunGroups | None                  # the run's groups ([Note: run groups])
    settings: Any                                 # its _ZeroSettings
    placement: GroupPlacement                     # offload/group_placement.py
    trainable_param_groups: Callable[[], list[list[torch.nn.Parameter]]]   # the wrapper's methods this mixin calls
    _publish_params: Callable[[], None]

    # --- [Note: checkpoint contract]: one optim file per dp rank ------------------------------
    def checkpoint_files(self, dp_rank: int, mp_rank: int) -> CheckpointFiles:
        bf16 = self.precision.param_dtype == torch.bfloat16
        return CheckpointFiles(model_states_name(0, mp_rank=mp_rank) if dp_rank == 0 else None,
                               optim_states_name(dp_rank, bf16, mp_rank))

    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout(self.zero_stage, self.dp_world_size)

    def frozen_param_records(self, module: torch.nn.Module) -> FrozenParamRecords:
        return frozen_param_records(module)

    def load_full_state(self, full: FullOptimizerState, param_names: dict[torch.nn.Parameter, str],
                        load_optimizer_states: bool) -> None:
        """Cut this rank's slice of each group's flat buffer ([Note: full layout]) from the named
        masters and moments; an expert group is partitioned over its expert-data-parallel group
        ([Note: MoE param groups]), experts named by global id (moe_reshard.py)."""
        current = with_loss_scaler(self.state_dict(), full)
        base = current[C.BASE_OPTIMIZER_STATE]
        full_names = moe_reshard.full_state_names(param_names, self.run_groups)
        state: dict[int, dict[str, Any]] = {}
        for g, params in enumerate(self.trainable_param_groups()):
            lean, moments, scalars = self._import_group(g, params, current, param_names, full_names, full)
            current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g] = lean
            if moments:
                state[base["param_groups"][g]["params"][0]] = {**scalars, **moments}
        base["state"] = state
        base["param_groups"] = with_hyperparams(base["param_groups"], full)
        current[C.PARTITION_COUNT] = [group.world_size for group in self.groups]
        self.load_state_dict(current, load_optimizer_states=load_optimizer_states)

    def _import_group(self, g: int, params: list[torch.nn.Parameter], current: dict[str, Any],
                      param_names: dict[torch.nn.Parameter, str], full_names: dict[str, str],
                      full: FullOptimizerState) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """Group g's fp32 partition, moments and scalars, cut from `full`."""
        lean = current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g]
        partition_numel = lean.numel() + int(current[C.GROUP_PADDINGS][g])
        offsets = flat_offsets(params, [param_names[p] for p in params])
        group_start = self.groups[g].dp_rank * partition_numel
        new_lean = torch.zeros_like(lean)
        moments: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for local_name, address in current[C.PARAM_SLICE_MAPPINGS][g].items():
            start, numel = fragment_bounds(address)
            param_start = group_start + start - offsets[local_name]
            name = full_names.get(local_name, local_name)
            new_lean.narrow(0, start, numel).copy_(require(full.fp32, name).reshape(-1).narrow(0, param_start, numel))
            for key, value in full.moments.get(name, {}).items():
                moment = moments.setdefault(key, torch.zeros(partition_numel, dtype=value.dtype))
                moment.narrow(0, start, numel).copy_(value.reshape(-1).narrow(0, param_start, numel))
            scalars = scalars or cloned(full.scalars.get(name, {}))
        return new_lean, moments, scalars

    # --- checkpoint state (DeepSpeed's `DeepSpeedZeroOptimizer.state_dict`, plain types) ------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
            "base_optimizer_state": self.placement.optimizer_state_dict(),
            "single_partition_of_fp32_groups": [
                self._fp32_partition(i).narrow(0, 0, g.layout.partition_numel - g.padding).detach().clone()
                for i, g in enumerate(self.groups)],
            "zero_stage": self.zero_stage,
            "group_paddings": [g.padding for g in self.groups],
            "partition_count": [g.world_size for g in self.groups],
            "ds_version": __version__,
            "param_slice_mappings": [self._slice_mappings(g) for g in self.groups],
            "param_alignment_paddings": [[0] * len(g.params) for g in self.groups],
        }

    def _fp32_partition(self, index: int) -> torch.Tensor:
        return self.placement.master_partition(index, self.groups[index].master)

    def _slice_mappings(self, group: Any) -> dict[str, dict[str, int]]:
        return {group.names[f.param_index]: {"numel": f.numel, "start": f.partition_start}
                for f in group.layout.fragments(group.dp_rank)}

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        self._check_loadable(state_dict)
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict["overflow"])
        self.clip_grad = float(state_dict.get("clip_grad", self.clip_grad))
        if load_optimizer_states:
            self.placement.load_optimizer_state_dict(state_dict["base_optimizer_state"])
        for index, (group, saved) in enumerate(zip(self.groups, state_dict["single_partition_of_fp32_groups"])):
            self.placement.load_master(index, group.master, group.lp_partition, saved,
                                       self.settings.load_from_fp32_weights)
        self._publish_params()

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        if "ds_version" not in state_dict:
            raise ValueError("ZeRO optimizer state has no 'ds_version': not a ZeRO 1/2 optimizer state dict")
        saved_counts = list(state_dict["partition_count"])
        if saved_counts != [g.world_size for g in self.groups]:
            raise ValueError(f"ZeRO optimizer state was saved with partition_count {saved_counts}; this run "
                             f"has {len(self.groups)} group(s) on {self.dp_world_size} data-parallel ranks. "
                             "Re-partitioning is done by the checkpoint loader, not load_state_dict.")
        for group, saved in zip(self.groups, state_dict["single_partition_of_fp32_groups"]):
            expected = group.layout.partition_numel - group.padding
            if saved.numel() != expected:
                raise ValueError(f"ZeRO fp32 partition has {saved.numel()} elements, expected {expected}: "
                                 "the checkpoint was saved for a different model or param groups")
