"""`DeepSpeedZeroOptimizer_Stage3`: partitioned gradients and the fp32 step (DeepSpeed's `deepspeed/runtime/zero/stage3.py::DeepSpeedZeroOptimizer_Stage3`).

Tensors per rank, for each optimizer sub-group k (params in group order, cut when the sum of their
`partition_numel()` reaches `sub_group_size`):
- `lp_flat[k]`: the sub-group's partitions end to end; every parameter's `ds_tensor` is a view
  into it. In fp32 it *is* the master: the base optimizer steps it in place (16 Psi / N bytes).
- `fp32_flat[k]`: the fp32 master (a separate copy only for fp16 / bf16), what the base optimizer's
  param groups hold — one "param" per sub-group (DeepSpeed's `fp32_partitioned_groups_flat`).
- `grad_flat[k]`: this rank's gradient partitions, in `grad_accum_dtype`, accumulated across
  micro-steps; padding stays zero. In host memory with `offload_optimizer` (note below).

Gradients reach `grad_flat` through stage3_gradients.py ([Note: gradient path]). The step:
overflow (fp16), global norm over the partitions (squares summed over ranks), unscale and clip,
base optimizer, copy to `lp_flat`, re-gather the persistent parameters. Nothing else is gathered:
parameters stay partitioned until the next forward fetches them.

Where each sub-group lives is decided once, at construction, by `self.placement`
([Note: sub-group placement] in offload/placement.py): `offload_param` puts `lp_flat[k]` on the
device, in host memory or in a swap file; `offload_optimizer` gives the masters and optimizer
state of the sub-groups k >= `num_on_device` (all of them unless `ratio < 1`: [Note: partial
offload] in partial_offload.py) to `OffloadStates` (host or NVMe), their `fp32_flat[k]` then only
a stand-in wrapping `lp_flat[k]` and `grad_flat[k]` a host buffer. This file asks the placement for
each sub-group's master, gradient buffer, step and copy-back, and never branches on offload.
Sub-groups are cut (sub_groups.py) before any is built; checkpoints: stage3_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer, StepGradients, tensor_bytes
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_space import GradSpace, Piece
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.muon.attach import attach_zero3
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.offload.offload_states import OffloadStates
from zerospeed.runtime.zero.offload.param_swapper import ParamSwapper
from zerospeed.runtime.zero.offload.placement import build_placement, resolve_aio_config
from zerospeed.runtime.zero.offload.config import OffloadStateTypeEnum
from zerospeed.runtime.zero.param_state import ZeroParameter, ZeroParamStatus, set_partition
from zerospeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from zerospeed.runtime.zero.stage3_checkpoint import Stage3Checkpointing
from zerospeed.runtime.zero.stage3_gradients import GradientSlot, Stage3GradientReducer
from zerospeed.runtime.zero.state_offload import StateTensors
from zerospeed.runtime.zero.sub_groups import plan_sub_groups

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "plan_sub_groups"]

class DeepSpeedZeroOptimizer_Stage3(Stage3Checkpointing, DeepSpeedOptimizer):
    supports_no_sync = False
    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, zero_config: Any,
                 precision: PrecisionSettings, loss_scaler: LossScaler, dp_group: Any,
                 param_names: dict[torch.nn.Parameter, str] | None = None,
                 offload: OffloadStates | None = None, aio_config: Any = None,
                 grad_space: GradSpace | None = None, run_groups: RunGroups | None = None) -> None:
        self._init_base(init_optimizer, loss_scaler, precision, grad_space or GradSpace.data_parallel(dp_group, True))
        self.offload = offload
        self.aio_config = resolve_aio_config(aio_config, offload)
        # Gradients may sit in host memory (optimizer offload, or `offload_param` alone, whose
        # sub-groups live on the host): the step's scalar collectives always run on the device.
        self._comm_device = torch.device(get_accelerator().current_device_name())
        self.zero_config = zero_config
        self.dp_group = dp_group
        self.world_size = comm.get_world_size(dp_group)
        self.dp_rank = comm.get_rank(dp_group)
        self.reduce_bucket_size = max(1, int(zero_config.reduce_bucket_size))
        self.overlap_comm = bool(zero_config.overlap_comm)
        self.parameter_offload = DeepSpeedZeRoOffload(module, zero_config, dp_group, param_names,
                                                      precision.param_dtype, run_groups)
        self._init_sub_groups()
        # Muon's matrix owners ([Note: owner-based Muon]); nothing for other optimizers
        attach_zero3(self.optimizer, self._group_ranges, self.fp16_groups,
                     lambda param: self._slots[id(param)].offset, dp_group, self.world_size, run_groups)
        self.placement.swap_out(self.lp_flat, self.fp32_flat, self.fp16_groups,
                                lambda param: self._slots[id(param)].offset)
        self.gradients = Stage3GradientReducer(
            [p for group in self.fp16_groups for p in group], self.grad_flat, self._slots, self.placement,
            precision=precision, dp_group=dp_group, reduce_bucket_numel=self.reduce_bucket_size,
            overlap_comm=self.overlap_comm, leaf_param_ids=self.parameter_offload.leaf_param_ids)

    # --- setup: [Note: sub-group placement] in offload/placement.py ------------------------------
    def _init_sub_groups(self) -> None:
        self.fp16_groups: list[list[ZeroParameter]] = []
        self.lp_flat: list[torch.Tensor] = []
        self.fp32_flat: list[torch.nn.Parameter] = []
        self.grad_flat: list[torch.Tensor] = []
        self._slots: dict[int, GradientSlot] = {}
        self._group_ranges: list[range] = []    # each param group's sub-group indices
        groups = self.optimizer.param_groups
        trainable = [[p for p in group["params"] if p.requires_grad] for group in groups]
        cuts = [plan_sub_groups([p.partition_numel() for p in params], int(self.zero_config.sub_group_size))
                for params in trainable]
        self.placement = build_placement(self.optimizer, self.zero_config, self.offload, self.aio_config,
                                         sum(len(group_cuts) for group_cuts in cuts), self._comm_device)
        for group, params, group_cuts in zip(groups, trainable, cuts):
            start = len(self.fp32_flat)
            masters = [self._build_sub_group([params[i] for i in cut]) for cut in group_cuts]
            self._group_ranges.append(range(start, len(self.fp32_flat)))
            self.placement.adopt(group, masters, start)
        self.placement.finish()

    def _build_sub_group(self, params: list[ZeroParameter]) -> torch.nn.Parameter:
        index = len(self.fp16_groups)
        lp = self.placement.partitions.place(torch.cat([p.ds_tensor.to(self.precision.param_dtype) for p in params]))
        offset = 0
        for param in params:
            size = param.partition_numel()
            set_partition(param, lp.narrow(0, offset, size))
            self._slots[id(param)] = GradientSlot(index, offset)
            offset += size
        master = self.placement.master(index, lp)
        self.fp16_groups.append(params)
        self.lp_flat.append(lp)
        self.fp32_flat.append(master)
        self.grad_flat.append(self.placement.grad_buffer(index, lp.numel(), self.precision.grad_accum_dtype,
                                                         master.device))
        return master

    # --- what the placement decided, under the names tests and tools read ----------------------------
    @property
    def sink(self) -> HostGradientSink | None:
        """With `offload_optimizer`: where offloaded sub-groups' gradients go during backward."""
        return self.placement.sink

    @property
    def num_on_device(self) -> int:
        """How many leading sub-groups keep their master on the device ([Note: partial offload])."""
        return self.placement.num_on_device

    @property
    def param_swapper(self) -> ParamSwapper | None:
        """With `offload_param: nvme`: the swap files of the partitions beyond `max_in_cpu`."""
        return self.placement.partitions.swapper

    # --- the step ([Note: one step] in base_optimizer.py) -------------------------------------------
    def backward_epilogue(self, is_boundary: bool) -> None:
        # before any gradient of this backward is reduced or stepped: [Note: gather-order check]
        self.parameter_offload.check_module_order()
        self.gradients.end_backward()
        self.parameter_offload.partition_all_parameters()

    def _step_gradients(self) -> StepGradients:
        self.gradients.finish()
        self.parameter_offload.partition_all_parameters()
        return StepGradients(self.grad_flat, self._comm_device)

    def _tensor_parallel_norm_pieces(self, grads: StepGradients) -> list[Piece]:
        # Each parameter's real partition elements, padding left out ([Note: gradient space] in grad_space.py);
        # the dp sum of these pieces is the tp rank's whole gradient.
        pieces = []
        for params, grad in zip(self.fp16_groups, grads.tensors):
            offset = 0
            for param in params:
                real = param.zs_state.real_partition_numel
                pieces.append((grad.narrow(0, offset, real), self.grad_space.part_of(param)))
                offset += param.partition_numel()
        return pieces

    def _apply_update(self, grads: list[torch.Tensor], multiplier: float) -> None:
        self.placement.step(self.fp32_flat, grads, multiplier)
        self._publish_masters()

    def _publish_masters(self) -> None:
        self.placement.publish(self.fp32_flat, self.lp_flat)
        self.parameter_offload.refresh_persistent_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for grad in self.grad_flat:
            grad.zero_()
        for master in self.fp32_flat:
            master.grad = None
        for group in self.fp16_groups:
            for param in group:
                param.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        state = self.placement.state_bytes(self.fp32_flat, self.precision.low_precision)
        breakdown = {
            "lp_params": tensor_bytes(self.lp_flat),
            "grads": tensor_bytes(self.grad_flat),
            "master_params": state["master_params"],
            "optimizer_states": state["optimizer_states"],
            "persistent_params": tensor_bytes([p.data for p in self.parameter_offload.params
                                               if p.zs_state.persist]),
        }
        breakdown["total"] = sum(breakdown.values())
        return breakdown

    def offloadable_state_tensors(self) -> StateTensors:
        """Every tensor object holding each state ([Note: storage relocation] in state_offload.py):
        the flat partitions and every parameter's `ds_tensor` (frozen ones included), the persistent
        parameters' gathered data, masters, gradients, optimizer state and the gradient slabs."""
        self.parameter_offload.partition_all_parameters()   # nothing else stays gathered
        params = self.parameter_offload.params
        gathered = [p for p in params if p.zs_state.persist and p.zs_state.status is ZeroParamStatus.AVAILABLE]
        kept = self.num_on_device   # the other sub-groups' masters and gradients belong to OffloadStates
        return {OffloadStateTypeEnum.lp_params: [*self.lp_flat, *(p.zs_state.partition for p in params), *gathered],
                OffloadStateTypeEnum.hp_params: list(self.fp32_flat[:kept]),
                OffloadStateTypeEnum.lp_grads: list(self.grad_flat[:kept]),
                OffloadStateTypeEnum.optim_states: self.placement.device_state_tensors(),
                OffloadStateTypeEnum.contiguous_grad_buffer: self.gradients.slab_buffers()}

    # --- DeepSpeed's names for the same things ------------------------------------------------------
    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.nn.Parameter]:
        return self.fp32_flat

    @property
    def fp16_partitioned_groups_flat(self) -> list[torch.Tensor]:
        return self.lp_flat

    @property
    def subgroup_to_device(self) -> dict[int, str]:
        """With `offload_optimizer`: where each sub-group's master and optimizer state live."""
        return self.placement.subgroup_to_device(len(self.fp32_flat))

    def trainable_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return list(self.fp16_groups)  # type: ignore[arg-type]

    def saves_16bit_model(self) -> bool:
        return bool(self.zero_config.gather_16bit_weights_on_model_save)

    def module_state_dict_16bit(self, module: torch.nn.Module,
                                exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        from zerospeed.runtime.zero.partition_parameters import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(module, exclude_frozen_parameters, self.dp_group)

    consolidated_16bit_state_dict = module_state_dict_16bit   # the weights are partitioned here

    def destroy(self) -> None:
        """The gradient hooks, the parameter fetch / release hooks, then the swap files."""
        self.gradients.remove_hooks()
        self.parameter_offload.remove_hooks()
        self.close()

    def partition_all_parameters(self) -> None:
        self.parameter_offload.partition_all_parameters()

    def close(self) -> None:
        """Wait for offload I/O and remove the swap files (also done at garbage collection and exit)."""
        self.placement.close()
