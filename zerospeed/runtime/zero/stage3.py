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

With `offload_optimizer` the fp32 masters and optimizer state of the offloaded sub-groups belong
to `OffloadStates` (offload_states.py: host memory or NVMe, stepped by the CPU optimizer, which
writes `lp_flat[k]` back); their `fp32_flat[k]` is then only a stand-in wrapping `lp_flat[k]`.
That is every sub-group unless `offload_optimizer.ratio < 1`: then the first `num_on_device`
sub-groups (sub_groups.py, DeepSpeed's rounding) take the path without offload, stepped by the
CPU optimizer's torch counterpart, and sub-group k >= num_on_device is `OffloadStates` partition
`k - num_on_device` ([Note: partial offload] in partial_offload.py). Sub-groups are cut and placed
(sub_groups.py) before any is built; checkpoints: stage3_checkpoint.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer, StepGradients, optimizer_state_tensors, tensor_bytes
from zerospeed.runtime.chunked_step import step_in_chunks
from zerospeed.runtime.config_sections import AioConfig
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_space import GradSpace, Piece
from zerospeed.runtime.grad_utils import scale_
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.muon.attach import attach_zero3
from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.offload.offload_states import OffloadStates
from zerospeed.runtime.zero.offload.param_swapper import ParamSwapper, SwappedFlatAccess
from zerospeed.runtime.zero.offload.partial_offload import build_device_optimizer
from zerospeed.runtime.zero.offload.config import OffloadStateTypeEnum
from zerospeed.runtime.zero.param_state import ZeroParameter, ZeroParamStatus, set_partition, set_swapped
from zerospeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from zerospeed.runtime.zero.stage3_checkpoint import Stage3Checkpointing
from zerospeed.runtime.zero.stage3_gradients import GradientSlot, Stage3GradientReducer
from zerospeed.runtime.zero.state_offload import StateTensors
from zerospeed.runtime.zero.sub_groups import num_sub_groups_on_device, plan_sub_groups

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "plan_sub_groups"]

class DeepSpeedZeroOptimizer_Stage3(Stage3Checkpointing, DeepSpeedOptimizer):
    supports_no_sync = False
    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, zero_config: Any,
                 precision: PrecisionSettings, loss_scaler: LossScaler, dp_group: Any,
                 param_names: dict[torch.nn.Parameter, str] | None = None,
                 offload: OffloadStates | None = None, aio_config: Any = None,
                 grad_space: GradSpace | None = None) -> None:
        self._init_base(init_optimizer, loss_scaler, precision, grad_space or GradSpace.data_parallel(dp_group, True))
        self.offload = offload
        self.aio_config = aio_config if aio_config is not None else (offload.aio_config if offload else AioConfig())
        # [Note: offloaded gradients at stage 3] in stage3_gradients.py
        self.sink = None if offload is None else HostGradientSink(bool(zero_config.offload_optimizer.pin_memory))
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
                                                      precision.param_dtype)
        self._init_sub_groups()
        # Muon's matrix owners ([Note: owner-based Muon]); nothing for other optimizers
        attach_zero3(self.optimizer, self._group_ranges, self.fp16_groups, self.fp32_flat,
                     lambda param: self._slots[id(param)].offset, dp_group, self.world_size)
        self.param_swapper = self._swap_out_partitions()
        self.gradients = Stage3GradientReducer(
            [p for group in self.fp16_groups for p in group], self.grad_flat, self._slots, self._offloaded,
            precision=precision, dp_group=dp_group, reduce_bucket_numel=self.reduce_bucket_size,
            overlap_comm=self.overlap_comm, sink=self.sink, leaf_param_ids=self.parameter_offload.leaf_param_ids)

    # --- setup --------------------------------------------------------------------------------
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
        num_sub_groups = sum(len(group_cuts) for group_cuts in cuts)
        # [Note: partial offload] in partial_offload.py; no offload places every sub-group as ratio 0 does
        ratio = float(self.zero_config.offload_optimizer.ratio) if self.offload is not None else 0.0
        self.num_on_device = num_sub_groups_on_device(num_sub_groups, ratio)
        on_device = []
        for group, params, group_cuts in zip(groups, trainable, cuts):
            start = len(self.fp32_flat)
            masters = [self._build_sub_group([params[i] for i in cut]) for cut in group_cuts]
            self._group_ranges.append(range(start, len(self.fp32_flat)))
            on_device.append([m for k, m in enumerate(masters, start) if not self._offloaded(k)])
            units = [unit for k, m in enumerate(masters, start) if self._offloaded(k)
                     for unit in self.offload.register(group, m.data)]  # type: ignore[union-attr]
            group["params"] = on_device[-1] if self.offload is None else units
        self._device_optimizer = self._init_device_optimizer(on_device, ratio)

    def _init_device_optimizer(self, on_device: list[list[torch.nn.Parameter]],
                               ratio: float) -> torch.optim.Optimizer | None:
        """What steps the masters kept on the device: the base optimizer without offload, its torch
        counterpart with `ratio < 1`, nothing with everything offloaded."""
        if self.offload is None:
            return self.optimizer
        return build_device_optimizer(self.optimizer, on_device) if ratio < 1 else None

    def _offloaded(self, sub_group: int) -> bool:
        """Whether `OffloadStates` holds this sub-group (as its partition `sub_group - num_on_device`)."""
        return sub_group >= self.num_on_device

    def _build_sub_group(self, params: list[ZeroParameter]) -> torch.nn.Parameter:
        index = len(self.fp16_groups)
        dtype = self.precision.param_dtype
        lp = self._place_partition(torch.cat([p.ds_tensor.to(dtype) for p in params]))
        offset = 0
        for param in params:
            size = param.partition_numel()
            set_partition(param, lp.narrow(0, offset, size))
            self._slots[id(param)] = GradientSlot(index, offset)
            offset += size
        offloaded = self._offloaded(index)
        if offloaded:  # a stand-in: OffloadStates holds the real master
            master = torch.nn.Parameter(lp)
        elif self._param_offload_alone():
            # [Note: offload_param alone] the master and the optimizer state stay on the compute
            # device (DeepSpeed's ZeRO-Infinity parameter offload); only `lp` lives on the host / NVMe.
            master = torch.nn.Parameter(lp.to(self._comm_device, torch.float32, copy=True))
        else:
            master = torch.nn.Parameter(lp if dtype == torch.float32 else lp.float())
        self.fp16_groups.append(params)
        self.lp_flat.append(lp)
        self.fp32_flat.append(master)
        dtype = self.precision.grad_accum_dtype
        self.grad_flat.append(self.sink.host_buffer(lp.numel(), dtype) if offloaded  # type: ignore[union-attr]
                              else torch.zeros(lp.numel(), dtype=dtype, device=master.device))
        return master

    def _param_offload_alone(self) -> bool:
        block = self.zero_config.offload_param
        return self.offload is None and block is not None and block.enabled

    def _place_partition(self, lp: torch.Tensor) -> torch.Tensor:
        """`offload_param`: the sub-group's partitions live in host memory (pinned with an
        accelerator); with `nvme`, `_swap_out_partitions` then moves most of them to files."""
        block = self.zero_config.offload_param
        if block is None or not block.enabled:
            return lp
        pin = bool(block.pin_memory) and torch.cuda.is_available()
        return torch.empty(lp.shape, dtype=lp.dtype, pin_memory=pin).copy_(lp)

    def _param_nvme_block(self) -> Any:
        block = self.zero_config.offload_param
        return block if block is not None and block.device.value == "nvme" else None

    def _swap_out_partitions(self) -> ParamSwapper | None:
        """`offload_param: nvme`: sub-groups beyond the first `max_in_cpu` elements (cumulative, in
        sub-group order: DeepSpeed's rule) are written to files and dropped from memory."""
        block = self._param_nvme_block()
        self._swapped_flats: dict[int, int] = {}
        if block is None:
            return None
        aio = self.aio_config
        swap_dir = os.path.join(str(block.nvme_path), "zerospeed_offload",
                                f"rank{comm.get_rank():02d}_pid{os.getpid()}", "param")
        swapper = ParamSwapper(swap_dir, AsyncIOEngine(aio.block_size, aio.queue_depth, aio.intra_op_parallelism),
                               int(block.buffer_count) * int(block.buffer_size), bool(block.pin_memory))
        flat_ids: dict[int, int] = {}
        in_cpu = 0
        for index, (lp, params) in enumerate(zip(self.lp_flat, self.fp16_groups)):
            if in_cpu + lp.numel() <= int(block.max_in_cpu):
                in_cpu += lp.numel()
                continue
            flat_ids[index] = swapper.add_flat(lp)
            for param in params:
                part = swapper.partition(flat_ids[index], self._slots[id(param)].offset, param.partition_numel())
                set_swapped(param, part)
            self._drop_flat(index, torch.empty(0, dtype=lp.dtype))
        self._swapped_flats = flat_ids
        if self.offload is not None:
            self.offload.partition_access = SwappedFlatAccess(swapper, self.offload.partitions, flat_ids)
        return swapper

    def _drop_flat(self, index: int, stand_in: torch.Tensor) -> None:
        """Every reference to sub-group `index`'s resident flat now points at `stand_in` (the master
        too when it is the flat itself: offloaded fp32; alone, the master is a device copy)."""
        self.lp_flat[index] = stand_in
        if self.offload is not None:
            self.fp32_flat[index].data = stand_in
            self.offload.partitions[index] = stand_in


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
        self._step_on_device(grads[:self.num_on_device], multiplier)
        if self.offload is not None:
            self.offload.step(grads[self.num_on_device:], multiplier)
        self._publish_masters()

    def _step_on_device(self, grads: list[torch.Tensor], multiplier: float) -> None:
        """The sub-groups whose masters are not offloaded: all of them without offload."""
        masters = self.fp32_flat[:len(grads)]
        if not masters:
            return
        for master, grad in zip(masters, grads):
            master.grad = grad if grad.dtype == master.dtype else grad.float()
        scale_([m.grad for m in masters], multiplier)
        step_in_chunks(self._device_optimizer)  # type: ignore[arg-type]  # [Note: chunked optimizer step]

    @torch.no_grad()
    def _publish_masters(self) -> None:
        swapped = self._swapped_flats if self.offload is None else {}  # with offload: written by its step
        for index, (master, lp) in enumerate(zip(self.fp32_flat, self.lp_flat)):
            master.grad = None
            if index in swapped:  # [Note: offload_param alone] the device master back to the file
                self.param_swapper.write_range(swapped[index], 0, master.detach().to("cpu", lp.dtype), wait=True)  # type: ignore[union-attr]
            elif master.data_ptr() != lp.data_ptr():
                lp.copy_(master)
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
        separate_master = self.precision.low_precision
        device = self._device_optimizer
        breakdown = {
            "lp_params": tensor_bytes(self.lp_flat),
            "grads": tensor_bytes(self.grad_flat),
            "master_params": tensor_bytes(self.fp32_flat[:self.num_on_device]) if separate_master else 0,
            "optimizer_states": tensor_bytes(optimizer_state_tensors(device)) if device is not None else 0,
            "persistent_params": tensor_bytes([p.data for p in self.parameter_offload.params
                                               if p.zs_state.persist]),
        }
        if self.offload is not None:
            offloaded = self.offload.memory_breakdown()
            breakdown["master_params"] += offloaded["master_params"]
            breakdown["optimizer_states"] += offloaded["optimizer_states"]
        breakdown["total"] = sum(breakdown.values())
        return breakdown

    def offloadable_state_tensors(self) -> StateTensors:
        """Every tensor object holding each state ([Note: storage relocation] in state_offload.py):
        the flat partitions and every parameter's `ds_tensor` (frozen ones included), the persistent
        parameters' gathered data, masters, gradients, optimizer state and the gradient slabs."""
        self.parameter_offload.partition_all_parameters()   # nothing else stays gathered
        params = self.parameter_offload.params
        gathered = [p for p in params if p.zs_state.persist and p.zs_state.status is ZeroParamStatus.AVAILABLE]
        kept = self.fp32_flat[:self.num_on_device]   # the other masters belong to OffloadStates
        device = self._device_optimizer
        return {OffloadStateTypeEnum.lp_params: [*self.lp_flat, *(p.zs_state.partition for p in params), *gathered],
                OffloadStateTypeEnum.hp_params: list(kept),
                OffloadStateTypeEnum.lp_grads: [g for k, g in enumerate(self.grad_flat) if not self._offloaded(k)],
                OffloadStateTypeEnum.optim_states: [] if device is None else optimizer_state_tensors(device),
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
        if self.offload is None:
            return {}
        device = get_accelerator().device_name()
        return {k: "cpu" if self._offloaded(k) else device for k in range(len(self.fp32_flat))}

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
        if self.param_swapper is not None:
            self.param_swapper.close()
        if self.offload is not None:
            self.offload.close()
