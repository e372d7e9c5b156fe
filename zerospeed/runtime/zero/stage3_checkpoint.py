"""`Stage3Checkpointing`: what a stage-3 wrapper saves and loads (DeepSpeed's `DeepSpeedZeroOptimizer_Stage3._rigid_state_dict`).

A mixin of `DeepSpeedZeroOptimizer_Stage3` (stage3.py), which owns every tensor named here. The
optimizer-states file holds, per sub-group k in order, the fp32 master `fp32_flat_groups[k]`
(padding kept) and the base optimizer's state for param k: one param per sub-group, whether the
master lives on the device, in `OffloadStates` (host or NVMe) or, with `offload_optimizer.ratio <
1`, some of each ([Note: partial offload] in partial_offload.py; the wrapper's `placement` answers which:
[Note: sub-group placement] in offload/placement.py). So a checkpoint loads into a run
with any other offload setting, and zero_to_fp32 reads `fp32_flat_groups` with `param_shapes()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.full_state_import import cloned, require, with_hyperparams, with_loss_scaler
from zerospeed.checkpoint.layout import model_states_name, optim_states_name

from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.checkpoint.contract import (CheckpointFiles, CheckpointLayout, FrozenParamRecords,
                                                       frozen_param_records)
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.config import ZeroStageEnum
from zerospeed.runtime.zero.offload.placement import SubGroupPlacement
from zerospeed.runtime.zero.param_state import ZeroParameter, rank_span
from zerospeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from zerospeed.version import __version__

if TYPE_CHECKING:
    from zerospeed.checkpoint.full_state import FullOptimizerState

__all__ = ["Stage3Checkpointing"]


class Stage3Checkpointing:
    """state_dict / load_state_dict / refresh_fp32_params and the model-states records of stage 3."""

    optimizer: torch.optim.Optimizer
    precision: PrecisionSettings
    loss_scaler: LossScaler
    overflow: bool
    clip_grad: float
    world_size: int
    dp_rank: int
    zero_config: Any
    parameter_offload: DeepSpeedZeRoOffload
    fp16_groups: list[list[ZeroParameter]]
    lp_flat: list[torch.Tensor]
    fp32_flat: list[torch.nn.Parameter]
    placement: SubGroupPlacement                  # [Note: sub-group placement] in offload/placement.py
    _group_ranges: list[range]
    _publish_masters: Callable[[], None]          # the wrapper's method this mixin calls

    # --- the optimizer-states file -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's stage-3 keys (`_rigid_state_dict`), plain types; `fp32_flat_groups` keep their padding."""
        return {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "overflow": self.overflow,
            "partition_count": self.world_size,
            "optimizer_state_dict": self._optimizer_state_dict(),
            "fp32_flat_groups": [self._fp32_flat_group(k) for k in range(len(self.fp32_flat))],
            "clip_grad": self.clip_grad,
            "ds_version": __version__,
        }

    def _optimizer_state_dict(self) -> dict[str, Any]:
        """The base optimizer's state_dict as without offload: one param per sub-group, in order."""
        return self.placement.optimizer_state_dict(self.fp32_flat, self._group_ranges)

    def _fp32_flat_group(self, index: int) -> torch.Tensor:
        return self.placement.master_copy(index, self.fp32_flat)

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if int(state_dict.get("partition_count", self.world_size)) != self.world_size:
            raise ValueError(f"checkpoint was saved with {state_dict['partition_count']} partitions, "
                             f"this run has {self.world_size}: re-partition it with the checkpoint tools")
        if load_optimizer_states:
            self.placement.load_optimizer_state_dict(state_dict["optimizer_state_dict"], self.fp32_flat)
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict.get("overflow", False))
        if self.zero_config.load_from_fp32_weights:
            with torch.no_grad():
                for index, saved in enumerate(state_dict["fp32_flat_groups"][:len(self.fp32_flat)]):
                    self.placement.load_master(index, saved, self.fp32_flat)
            self._publish_masters()
        else:
            self.refresh_fp32_params()

    def refresh_fp32_params(self) -> None:
        """Re-derive the fp32 masters from the (just loaded) low-precision partitions."""
        self.placement.refresh_masters(self.fp32_flat, self.lp_flat)

    # --- the checkpoint contract ([Note: checkpoint contract]): the module holds partitions only ------
    weights_in_optimizer_files = True

    def checkpoint_files(self, dp_rank: int, mp_rank: int) -> CheckpointFiles:
        """Every dp rank writes its own model-states file (its module's tensors are placeholders) and
        its optim file."""
        bf16 = self.precision.param_dtype == torch.bfloat16
        return CheckpointFiles(model_states_name(3, dp_rank, mp_rank), optim_states_name(dp_rank, bf16, mp_rank))

    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout(int(ZeroStageEnum.weights), self.world_size)

    def frozen_param_records(self, module: torch.nn.Module) -> FrozenParamRecords:
        return frozen_param_records(module)

    def gathered_parameters(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
        from zerospeed.runtime.zero.partition_parameters import GatheredParameters

        return GatheredParameters(params)

    def load_full_state(self, full: FullOptimizerState, param_names: dict[torch.nn.Parameter, str],
                        load_optimizer_states: bool) -> None:
        """Cut this rank's chunk of every parameter ([Note: full layout]) into its sub-group flats;
        padding stays zero. `load_state_dict` copies the masters into the partitions."""
        current = with_loss_scaler(self.state_dict(), full)
        base = current[C.OPTIMIZER_STATE_DICT]
        indices = [index for group in base["param_groups"] for index in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for k, params in enumerate(self.fp16_groups):
            flat = torch.zeros_like(current[C.FP32_FLAT_GROUPS][k])
            moments: dict[str, torch.Tensor] = {}
            scalars: dict[str, Any] = {}
            offset = 0
            for param in params:
                name, world, rank = moe_reshard.import_coords(param, param_names[param], self.world_size, self.dp_rank,
                                                               self.parameter_offload.run_groups)
                start, real_numel = rank_span(param.zs_state.numel, world, rank)   # experts: [Note: MoE stage-3 reshard]
                flat.narrow(0, offset, real_numel).copy_(require(full.fp32, name).reshape(-1).narrow(0, start, real_numel))
                for key, value in full.moments.get(name, {}).items():
                    moment = moments.setdefault(key, torch.zeros(flat.numel(), dtype=value.dtype))
                    moment.narrow(0, offset, real_numel).copy_(value.reshape(-1).narrow(0, start, real_numel))
                scalars = scalars or cloned(full.scalars.get(name, {}))
                offset += param.partition_numel()
            current[C.FP32_FLAT_GROUPS][k] = flat
            if moments:
                state[indices[k]] = {**scalars, **moments}
        base["state"] = state
        base["param_groups"] = with_hyperparams(base["param_groups"], full)
        current[C.PARTITION_COUNT] = self.world_size
        self.load_state_dict(current, load_optimizer_states=load_optimizer_states)

    # --- what a checkpoint's model-states file records (`DeepSpeedEngine._save_checkpoint`) -----------------------------
    def param_shapes(self, param_names: dict[torch.nn.Parameter, str] | None = None) -> list[dict[str, torch.Size]]:
        """Per sub-group, name -> full shape of each trainable param, in flat-partition order
        (DeepSpeed's `param_shapes`: zero_to_fp32 walks `fp32_flat_groups` with it). The names are
        the parameters' own (`zs_state.name`); the module's parameters are (0,) placeholders."""
        return [{p.zs_state.name: p.zs_state.shape for p in group} for group in self.fp16_groups]

    def frozen_params(self) -> list[ZeroParameter]:
        """Partitioned params outside the optimizer (no gradient), in ds_id order."""
        trainable = {id(p) for group in self.fp16_groups for p in group}
        return sorted((p for p in self.parameter_offload.params if id(p) not in trainable),
                      key=lambda p: p.zs_state.ds_id)

