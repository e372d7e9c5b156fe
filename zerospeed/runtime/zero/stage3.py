"""`DeepSpeedZeroOptimizer_Stage3`: partitioned gradients and the fp32 step (reference §5.4).

Tensors per rank, for each optimizer sub-group k (params in group order, cut when the sum of their
`partition_numel()` reaches `sub_group_size`):
- `lp_flat[k]`: the sub-group's partitions end to end; every parameter's `ds_tensor` is a view
  into it. In fp32 it *is* the master: the base optimizer steps it in place (16 Psi / N bytes).
- `fp32_flat[k]`: the fp32 master (a separate copy only for fp16 / bf16), what the base optimizer's
  param groups hold — one "param" per sub-group (DeepSpeed's `fp32_partitioned_groups_flat`).
- `grad_flat[k]`: this rank's gradient partitions, in `grad_accum_dtype`, accumulated across
  micro-steps; padding stays zero. In host memory with `offload_optimizer` (note below).

[Note: gradient path]
A post-accumulate-grad hook on each trainable parameter hands its full gradient to the bucket and
drops `param.grad`. A bucket of `reduce_bucket_size` elements is one `reduce_scatter_tensor`: its
input is `W` rows, row r the concatenation of each parameter's r-th chunk (zero-padded), so rank r
receives exactly its partitions. With `overlap_comm` the reduce-scatter is asynchronous, at most
two in flight, each only ever `wait()`ed (gloo). Results are added into `grad_flat` once waited.
The step: overflow (fp16), global norm over the partitions (squares summed over ranks), unscale
and clip, base optimizer, copy to `lp_flat`, re-gather the persistent parameters. Nothing else
is gathered: parameters stay partitioned until the next forward fetches them.

With `offload_optimizer` the fp32 masters and optimizer state of every sub-group belong to
`OffloadStates` (offload_states.py: host memory or NVMe, stepped by the CPU optimizer, which writes
`lp_flat[k]` back); `fp32_flat[k]` is then only a stand-in wrapping `lp_flat[k]`.

[Note: offloaded gradients at stage 3]
With `offload_optimizer` every `grad_flat[k]` is a host buffer (pinned when applicable) and each
reduce-scattered bucket reaches it through a `HostGradientSink` (host_grads.py) as the bucket
completes, overlapped with the rest of backward, as at stages 1 and 2 ([Note: offloaded
gradients] in stage_1_and_2.py); the sink holds the bucket's output until its copy has landed.
A slice whose widening to `grad_accum_dtype` is exact (bf16 into fp32) crosses as it is, half the
bytes, and the host add widens it; a narrowing is done on the device first, as without offload,
so both runs round the same way. `_finish_reductions` synchronizes the sink, so the overflow
check, the norm (their per-rank scalar reduced on the accelerator) and `OffloadStates.step`
(which takes views, no copy at the step) read final host gradients.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer, optimizer_state_tensors, tensor_bytes
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_utils import any_non_finite, global_norm, scale_, unscale_and_clip_factor
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors
from zerospeed.runtime.zero.config import ZeroStageEnum
from zerospeed.runtime.zero.host_grads import HostGradientSink
from zerospeed.runtime.zero.offload_states import OffloadStates
from zerospeed.runtime.swap_tensor.aio_engine import AsyncIOEngine
from zerospeed.runtime.swap_tensor.param_swapper import ParamSwapper, SwappedFlatAccess
from zerospeed.runtime.zero.param_state import ZeroParameter, rank_span, set_partition, set_swapped
from zerospeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from zerospeed.version import __version__

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "plan_sub_groups"]

_MAX_IN_FLIGHT = 2


def plan_sub_groups(partition_numels: list[int], sub_group_size: int) -> list[list[int]]:
    """Indices cut into runs whose partition numel first reaches `sub_group_size` (pure)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, numel in enumerate(partition_numels):
        current.append(index)
        total += numel
        if total >= sub_group_size:
            groups.append(current)
            current, total = [], 0
    if current:
        groups.append(current)
    return groups


def _for_host_add(reduced: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the sink adds into a host `dtype` buffer: `reduced` itself when widening it to `dtype`
    is exact (the host add then gives the bits of the device path's convert-then-add), else
    `reduced` converted on the device, which rounds exactly as the path without offload does."""
    return reduced if torch.promote_types(reduced.dtype, dtype) == dtype else reduced.to(dtype)


@dataclasses.dataclass
class _Slot:
    """Where a trainable parameter's partition lives: sub-group and offset in its flats."""

    sub_group: int
    offset: int


@dataclasses.dataclass
class _InFlight:
    work: Any
    rows: torch.Tensor
    output: torch.Tensor
    params: list[ZeroParameter]


class DeepSpeedZeroOptimizer_Stage3(DeepSpeedOptimizer):
    def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, zero_config: Any,
                 precision: PrecisionSettings, loss_scaler: LossScaler, dp_group: Any,
                 param_names: dict[torch.nn.Parameter, str] | None = None,
                 offload: OffloadStates | None = None) -> None:
        self._init_base(init_optimizer, loss_scaler, precision.clip_grad)
        self.offload = offload
        # [Note: offloaded gradients at stage 3]
        self.sink = None if offload is None else HostGradientSink(bool(zero_config.offload_optimizer.pin_memory))
        self._comm_device = None if offload is None else torch.device(get_accelerator().current_device_name())
        self.precision = precision
        self.zero_config = zero_config
        self.dp_group = dp_group
        self.world_size = comm.get_world_size(dp_group)
        self.dp_rank = comm.get_rank(dp_group)
        self.reduce_bucket_size = max(1, int(zero_config.reduce_bucket_size))
        self.overlap_comm = bool(zero_config.overlap_comm)
        self.parameter_offload = DeepSpeedZeRoOffload(module, zero_config, dp_group, param_names,
                                                      precision.param_dtype)
        self._check_param_offload()
        self._init_sub_groups()
        self.param_swapper = self._swap_out_partitions()
        self._init_gradient_hooks()

    # --- setup --------------------------------------------------------------------------------
    def _init_sub_groups(self) -> None:
        self.fp16_groups: list[list[ZeroParameter]] = []
        self.lp_flat: list[torch.Tensor] = []
        self.fp32_flat: list[torch.nn.Parameter] = []
        self.grad_flat: list[torch.Tensor] = []
        self._slots: dict[int, _Slot] = {}
        for group in self.optimizer.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            cuts = plan_sub_groups([p.partition_numel() for p in trainable], int(self.zero_config.sub_group_size))
            masters = [self._build_sub_group([trainable[i] for i in cut]) for cut in cuts]
            if self.offload is not None:
                masters = [unit for master in masters for unit in self.offload.register(group, master.data)]
            group["params"] = masters

    def _build_sub_group(self, params: list[ZeroParameter]) -> torch.nn.Parameter:
        index = len(self.fp16_groups)
        dtype = self.precision.param_dtype
        lp = self._place_partition(torch.cat([p.ds_tensor.to(dtype) for p in params]))
        offset = 0
        for param in params:
            size = param.partition_numel()
            set_partition(param, lp.narrow(0, offset, size))
            self._slots[id(param)] = _Slot(index, offset)
            offset += size
        master = torch.nn.Parameter(lp if dtype == torch.float32 or self.offload is not None else lp.float())
        self.fp16_groups.append(params)
        self.lp_flat.append(lp)
        self.fp32_flat.append(master)
        dtype = self.precision.grad_accum_dtype
        self.grad_flat.append(torch.zeros_like(lp, dtype=dtype) if self.sink is None
                              else self.sink.host_buffer(lp.numel(), dtype))
        return master

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

    def _check_param_offload(self) -> None:
        if self._param_nvme_block() is not None and self.offload is None:
            raise ValueError("zero_optimization.offload_param.device 'nvme' needs optimizer offload as well: set "
                             "zero_optimization.offload_optimizer.device to 'cpu' or 'nvme' (the optimizer step "
                             "then updates the swapped parameter partitions on the host)")

    def _swap_out_partitions(self) -> ParamSwapper | None:
        """`offload_param: nvme`: sub-groups beyond the first `max_in_cpu` elements (cumulative, in
        sub-group order: DeepSpeed's rule) are written to files and dropped from memory."""
        block = self._param_nvme_block()
        if block is None:
            return None
        aio = self.offload.aio_config  # type: ignore[union-attr]
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
        self.offload.partition_access = SwappedFlatAccess(swapper, self.offload.partitions, flat_ids)  # type: ignore[union-attr]
        return swapper

    def _drop_flat(self, index: int, stand_in: torch.Tensor) -> None:
        """Every reference to sub-group `index`'s resident flat now points at `stand_in`."""
        self.lp_flat[index] = stand_in
        self.fp32_flat[index].data = stand_in
        self.offload.partitions[index] = stand_in  # type: ignore[union-attr]

    def _init_gradient_hooks(self) -> None:
        self._bucket: list[tuple[ZeroParameter, torch.Tensor]] = []
        self._bucket_numel = 0
        self._in_flight: list[_InFlight] = []
        self._deferred: dict[int, torch.Tensor] = {}
        leaf_ids = self.parameter_offload.leaf_param_ids
        self._leaf_params = sorted((p for g in self.fp16_groups for p in g if p.zs_state.ds_id in leaf_ids),
                                   key=lambda p: p.zs_state.ds_id)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for group in self.fp16_groups for p in group]

    # --- gradients ----------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        state = param.zs_state  # type: ignore[attr-defined]
        if grad is None:
            return
        if grad.numel() != state.numel:
            raise RuntimeError(f"ZeRO-3: gradient of parameter {state.describe()} has shape {tuple(grad.shape)}: "
                               "the parameter was used while partitioned (outside the forward of a module "
                               "that owns it). Register it with zero.register_external_parameter(module, "
                               "param) or use it inside zero.GatheredParameters.")
        if state.ds_id in self.parameter_offload.leaf_param_ids:
            self._deferred[state.ds_id] = grad  # see [Note: leaf-module gradients]
            return
        self._add_to_bucket(param, grad)  # type: ignore[arg-type]

    def _add_to_bucket(self, param: ZeroParameter, grad: torch.Tensor) -> None:
        self._bucket.append((param, grad))
        self._bucket_numel += param.zs_state.padded_numel
        if self._bucket_numel >= self.reduce_bucket_size:
            self._flush_bucket()

    def _reduce_deferred(self) -> None:
        """[Note: leaf-module gradients] Inside a z3-leaf module (an MoE layer) which parameters
        get a gradient depends on each rank's data, so their hooks fire in different orders and
        numbers on different ranks. Their gradients wait here and are reduced at the end of
        backward in ds_id order, zeros standing in for a missing one: the same collectives on
        every rank."""
        for param in self._leaf_params:
            grad = self._deferred.pop(param.zs_state.ds_id, None)
            if grad is None:
                grad = torch.zeros(param.zs_state.shape, dtype=param.dtype, device=param.ds_tensor.device)
            self._add_to_bucket(param, grad)

    def _flush_bucket(self) -> None:
        if not self._bucket:
            return
        comm_dtype = self.precision.communication_dtype
        width = sum(p.partition_numel() for p, _ in self._bucket)
        rows = torch.zeros(self.world_size, width, dtype=comm_dtype, device=self._bucket[0][1].device)
        offset = 0
        for param, grad in self._bucket:
            flat = grad.reshape(-1)
            for rank in range(self.world_size):
                start, real = rank_span(flat.numel(), self.world_size, rank)
                if real:
                    rows[rank, offset:offset + real].copy_(flat[start:start + real])
            offset += param.partition_numel()
        before, _ = self._averaging()
        if before != 1.0:
            rows.mul_(before)
        output = torch.empty(width, dtype=comm_dtype, device=rows.device)
        work = comm.reduce_scatter_tensor(output, rows.view(-1), group=self.dp_group, async_op=self.overlap_comm)
        self._in_flight.append(_InFlight(work, rows, output, [p for p, _ in self._bucket]))
        self._bucket, self._bucket_numel = [], 0
        while len(self._in_flight) > (_MAX_IN_FLIGHT - 1 if self.overlap_comm else 0):
            self._finish(self._in_flight.pop(0))

    def _averaging(self) -> tuple[float, float]:
        """(before, after) multipliers around the sum (DeepSpeed's averaging rules, §3.9)."""
        return averaging_factors(self.precision, self.world_size)

    def _finish(self, flight: _InFlight) -> None:
        if flight.work is not None:
            flight.work.wait()
        _, after = self._averaging()
        if after != 1.0:
            flight.output.mul_(after)
        offset = 0
        for param in flight.params:
            size = param.partition_numel()
            slot = self._slots[id(param)]
            dest = self.grad_flat[slot.sub_group].narrow(0, slot.offset, size)
            reduced = flight.output.narrow(0, offset, size)
            if self.sink is None:
                dest.add_(reduced.to(dest.dtype))
            else:   # [Note: offloaded gradients at stage 3]
                self.sink.add(dest, _for_host_add(reduced, dest.dtype))
            offset += size

    def backward_epilogue(self, is_boundary: bool) -> None:
        self._reduce_deferred()
        self._finish_reductions()

    def _finish_reductions(self) -> None:
        self._flush_bucket()
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        if self.sink is not None:
            self.sink.synchronize()   # [Note: offloaded gradients at stage 3] what reads grad_flat comes next
        self.parameter_offload.partition_all_parameters()

    # --- the step -----------------------------------------------------------------------------
    def step(self, closure: Any = None) -> None:
        self._finish_reductions()
        grads, device = self.grad_flat, self._comm_device
        self.overflow = self.precision.check_overflow and any_non_finite(grads, group=self.dp_group,
                                                                         comm_device=device)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self.zero_grad()
            return
        scaled_norm = global_norm(grads, group=self.dp_group, partitioned=True, comm_device=device)
        self._global_grad_norm = scaled_norm / self.loss_scale
        divisor = unscale_and_clip_factor(scaled_norm, self.loss_scale, self.clip_grad)
        if self.offload is not None:
            self.offload.step(grads, 1.0 / divisor)
            self._publish_masters()
            return
        for master, grad in zip(self.fp32_flat, grads):
            master.grad = grad if grad.dtype == master.dtype else grad.float()
        scale_([m.grad for m in self.fp32_flat], 1.0 / divisor)
        self.optimizer.step()
        self._publish_masters()

    @torch.no_grad()
    def _publish_masters(self) -> None:
        for master, lp in zip(self.fp32_flat, self.lp_flat):
            master.grad = None
            if master.data_ptr() != lp.data_ptr():
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

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's stage-3 keys (§5.4), plain types; `fp32_flat_groups` keep their padding."""
        return {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "overflow": self.overflow,
            "partition_count": self.world_size,
            "optimizer_state_dict": self.offload.optimizer_state_dict() if self.offload is not None
            else self.optimizer.state_dict(),
            "fp32_flat_groups": [self._fp32_flat_group(k) for k in range(len(self.fp32_flat))],
            "clip_grad": self.clip_grad,
            "ds_version": __version__,
        }

    def _fp32_flat_group(self, index: int) -> torch.Tensor:
        if self.offload is not None:
            return self.offload.master_partition(index)
        return self.fp32_flat[index].detach().float().clone()

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if int(state_dict.get("partition_count", self.world_size)) != self.world_size:
            raise ValueError(f"checkpoint was saved with {state_dict['partition_count']} partitions, "
                             f"this run has {self.world_size}: re-partition it with the checkpoint tools")
        if load_optimizer_states and self.offload is not None:
            self.offload.load_optimizer_state_dict(state_dict["optimizer_state_dict"])
        elif load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict.get("overflow", False))
        if self.zero_config.load_from_fp32_weights:
            with torch.no_grad():
                for index, (master, saved) in enumerate(zip(self.fp32_flat, state_dict["fp32_flat_groups"])):
                    if self.offload is not None:
                        self.offload.load_master_partition(index, saved)
                    else:
                        master.copy_(saved)
            self._publish_masters()
        else:
            self.refresh_fp32_params()

    def refresh_fp32_params(self) -> None:
        """Re-derive the fp32 masters from the (just loaded) low-precision partitions."""
        if self.offload is not None:
            self.offload.refresh_from_partitions()
            return
        with torch.no_grad():
            for master, lp in zip(self.fp32_flat, self.lp_flat):
                if master.data_ptr() != lp.data_ptr():
                    master.copy_(lp)

    def memory_breakdown(self) -> dict[str, int]:
        separate_master = self.precision.low_precision
        breakdown = {
            "lp_params": tensor_bytes(self.lp_flat),
            "grads": tensor_bytes(self.grad_flat),
            "master_params": tensor_bytes(self.fp32_flat) if separate_master else 0,
            "optimizer_states": tensor_bytes(optimizer_state_tensors(self.optimizer)),
            "persistent_params": tensor_bytes([p.data for p in self.parameter_offload.params
                                               if p.zs_state.persist]),
        }
        if self.offload is not None:
            offloaded = self.offload.memory_breakdown()
            breakdown.update(master_params=offloaded["master_params"], optimizer_states=offloaded["optimizer_states"])
        breakdown["total"] = sum(breakdown.values())
        return breakdown

    # --- what a checkpoint's model-states file records (reference §7.2) -----------------------------
    def param_shapes(self) -> list[dict[str, torch.Size]]:
        """Per sub-group, name -> full shape of each trainable param, in flat-partition order
        (DeepSpeed's `param_shapes`: zero_to_fp32 walks `fp32_flat_groups` with it)."""
        return [{p.zs_state.name: p.zs_state.shape for p in group} for group in self.fp16_groups]

    def frozen_params(self) -> list[ZeroParameter]:
        """Partitioned params outside the optimizer (no gradient), in ds_id order."""
        trainable = {id(p) for group in self.fp16_groups for p in group}
        return sorted((p for p in self.parameter_offload.params if id(p) not in trainable),
                      key=lambda p: p.zs_state.ds_id)

    # --- DeepSpeed's names for the same things ------------------------------------------------------
    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.nn.Parameter]:
        return self.fp32_flat

    @property
    def fp16_partitioned_groups_flat(self) -> list[torch.Tensor]:
        return self.lp_flat

    def partition_all_parameters(self) -> None:
        self.parameter_offload.partition_all_parameters()

    def close(self) -> None:
        """Wait for offload I/O and remove the swap files (also done at garbage collection and exit)."""
        if self.param_swapper is not None:
            self.param_swapper.close()
        if self.offload is not None:
            self.offload.close()
