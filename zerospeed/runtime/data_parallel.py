"""Stage 0: replicated parameters, gradients all-reduced in buckets at the accumulation boundary.

The same wrapper serves fp32, fp16 and bf16. In low precision the module holds fp16 / bf16
parameters and the base optimizer holds one fp32 master per trainable parameter (the param
groups are re-pointed at the masters), so the update happens in fp32 and is copied back.
Gradients accumulate across micro-batches in `grad_accum_dtype`: in the parameters' own `.grad`
when that is the model dtype, else in a separate buffer per parameter filled after each backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zerospeed import comm
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer, optimizer_state_tensors, tensor_bytes
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_utils import any_non_finite, global_norm, scale_, unscale_and_clip_factor
from zerospeed.runtime.precision import PrecisionSettings, average_in_place
from zerospeed.utils.logging import logger


def trainable_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def bucket_by_numel(tensors: list[torch.Tensor], bucket_numel: int) -> list[list[int]]:
    """Indices of `tensors` grouped, in order, into runs of one dtype with at most `bucket_numel`
    elements (a tensor larger than the bucket is a bucket of its own)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index, tensor in enumerate(tensors):
        same_dtype = not current or tensors[current[0]].dtype == tensor.dtype
        if current and (not same_dtype or current_numel + tensor.numel() > bucket_numel):
            buckets.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += tensor.numel()
    if current:
        buckets.append(current)
    return buckets


class DataParallelOptimizer(DeepSpeedOptimizer):
    """ZeRO stage 0 (plain data parallelism) for fp32, fp16 and bf16."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, precision: PrecisionSettings,
                 loss_scaler: LossScaler, dp_group: Any, reduce_bucket_size: int) -> None:
        self._init_base(init_optimizer, loss_scaler, precision.clip_grad)
        self.precision = precision
        self.dp_group = dp_group
        self.reduce_bucket_size = int(reduce_bucket_size)
        self._lp_params = trainable_params(init_optimizer)
        self._masters = self._init_fp32_masters() if precision.low_precision else self._lp_params
        self._accum_grads: list[torch.Tensor | None] = [None] * len(self._lp_params)

    def _init_fp32_masters(self) -> list[torch.Tensor]:
        """Replace each trainable param in the optimizer's groups by an fp32 copy (its master)."""
        master_of: dict[int, torch.nn.Parameter] = {}
        for group in self.optimizer.param_groups:
            group["params"] = [self._master(p, master_of) if p.requires_grad else p for p in group["params"]]
        return [master_of[id(p)] for p in self._lp_params]

    @staticmethod
    def _master(param: torch.nn.Parameter, master_of: dict[int, torch.nn.Parameter]) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().clone().float())
        master_of[id(param)] = master
        return master

    # --- gradients ----------------------------------------------------------------------------
    @property
    def _separate_accumulation(self) -> bool:
        return self.precision.grad_accum_dtype != self.precision.param_dtype

    def backward_epilogue(self, is_boundary: bool) -> None:
        if self._separate_accumulation:
            self._move_grads_to_accumulators()
        if is_boundary:
            self._allreduce_gradients()

    def _move_grads_to_accumulators(self) -> None:
        for index, param in enumerate(self._lp_params):
            if param.grad is None:
                continue
            grad = param.grad.to(self.precision.grad_accum_dtype)
            acc = self._accum_grads[index]
            self._accum_grads[index] = grad if acc is None else acc.add_(grad)
            param.grad = None

    def _gradients(self) -> list[torch.Tensor]:
        """The accumulated gradient of every trainable param (zeros where none was produced, so
        every rank reduces the same sizes)."""
        grads = []
        for index, param in enumerate(self._lp_params):
            holder_grad = self._accum_grads[index] if self._separate_accumulation else param.grad
            if holder_grad is None:
                holder_grad = torch.zeros_like(param, dtype=self.precision.grad_accum_dtype)
                self._store_grad(index, holder_grad)
            grads.append(holder_grad)
        return grads

    def _store_grad(self, index: int, grad: torch.Tensor) -> None:
        if self._separate_accumulation:
            self._accum_grads[index] = grad
        else:
            self._lp_params[index].grad = grad

    def _allreduce_gradients(self) -> None:
        grads = self._gradients()
        world_size = comm.get_world_size(self.dp_group)
        comm_dtype = self.precision.communication_dtype
        for bucket in bucket_by_numel(grads, self.reduce_bucket_size):
            bucket_grads = [grads[i] for i in bucket]
            flat = _flatten_dense_tensors(bucket_grads)
            flat = flat.to(comm_dtype) if flat.dtype != comm_dtype else flat
            average_in_place(flat, world_size, self.precision,
                             lambda t: comm.all_reduce(t, group=self.dp_group))
            for grad, reduced in zip(bucket_grads, _unflatten_dense_tensors(flat, bucket_grads)):
                grad.copy_(reduced)

    # --- the step -----------------------------------------------------------------------------
    def step(self, closure: Any = None) -> None:
        grads = self._gradients()
        # Gradients are already all-reduced, so every rank sees the same overflow: no collective.
        self.overflow = self.precision.check_overflow and any_non_finite(grads, reduce=False)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self.zero_grad()
            return
        scaled_norm = global_norm(grads)
        self._global_grad_norm = scaled_norm / self.loss_scale
        divisor = unscale_and_clip_factor(scaled_norm, self.loss_scale, self.clip_grad)
        for master, grad in zip(self._masters, grads):
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
        scale_([m.grad for m in self._masters], 1.0 / divisor)
        self.optimizer.step()
        if self.precision.low_precision:
            self._copy_masters_to_params()

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        for param, master in zip(self._lp_params, self._masters):
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._lp_params:
            param.grad = None
        for master in self._masters:
            master.grad = None
        self._accum_grads = [None] * len(self._lp_params)

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "optimizer_state_dict": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
        }
        if self.precision.low_precision:
            state["fp32_groups"] = [m.detach().clone() for m in self._masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict.get("overflow", False))
        if self.precision.low_precision and "fp32_groups" in state_dict:
            with torch.no_grad():
                for master, saved in zip(self._masters, state_dict["fp32_groups"]):
                    master.copy_(saved)
            self._copy_masters_to_params()

    def refresh_fp32_params(self) -> None:
        """Re-derive the fp32 masters from the (just loaded) low-precision module weights."""
        if self.precision.low_precision:
            with torch.no_grad():
                for master, param in zip(self._masters, self._lp_params):
                    master.copy_(param)

    def memory_breakdown(self) -> dict[str, int]:
        grads = [p.grad for p in self._lp_params] + list(self._accum_grads)
        breakdown = {
            "lp_params": tensor_bytes(self._lp_params),
            "grads": tensor_bytes([g for g in grads if g is not None]),
            "master_params": tensor_bytes(self._masters) if self.precision.low_precision else 0,
            "optimizer_states": tensor_bytes(optimizer_state_tensors(self.optimizer)),
        }
        breakdown["total"] = sum(breakdown.values())
        return breakdown


def log_skipped_step(global_step: int, loss_scale: float) -> None:
    logger.warning("Skipped step %d: gradients overflowed (inf/nan); loss scale now %s", global_step, loss_scale)
