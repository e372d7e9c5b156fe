"""The interface between the engine and every optimizer wrapper (stage 0, ZeRO 1/2, ZeRO 3).

[Note: engine / optimizer contract]
The engine owns sequencing (micro-steps, accumulation boundaries, the scheduler, logging); a
wrapper owns the tensors (low-precision params, gradients, fp32 masters, optimizer state) and all
gradient communication. Per micro-batch the engine calls

    wrapper.prepare_backward(will_reduce=is_boundary and not inside no_sync)
    scaled = wrapper.scale_loss(loss / gradient_accumulation_steps)
    scaled.backward()
    wrapper.backward_epilogue(is_boundary)       # skipped inside engine.no_sync()

and at the accumulation boundary `wrapper.step()` then `wrapper.zero_grad()`. `step()` reduces
what is still unreduced, checks for overflow (setting `self.overflow`; the loss scaler is
updated on every step), computes `_global_grad_norm` (unscaled), unscales and clips, runs the
base optimizer and makes the updated parameters visible to the module. The scheduler drives
`param_groups`, which are the base optimizer's.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from zerospeed.runtime.fp16.loss_scaler import LossScaler


class DeepSpeedOptimizer(abc.ABC):
    """Base of every zerospeed optimizer wrapper (DeepSpeed's name, so `isinstance` checks port)."""

    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    clip_grad: float
    overflow: bool
    _global_grad_norm: float | None

    def _init_base(self, optimizer: torch.optim.Optimizer, loss_scaler: LossScaler, clip_grad: float) -> None:
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.clip_grad = float(clip_grad)
        self.overflow = False
        self._global_grad_norm = None

    # --- what the scheduler and users see ---------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.loss_scaler.scale_loss(loss)

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    # --- the contract -----------------------------------------------------------------------
    def prepare_backward(self, will_reduce: bool) -> None:
        """Before each micro-batch's backward: whether its epilogue will reduce (the boundary, outside
        no_sync), so a wrapper can start reducing from gradient hooks while backward runs."""

    @abc.abstractmethod
    def backward_epilogue(self, is_boundary: bool) -> None:
        """After each micro-batch's backward: reduce / accumulate the gradients it produced."""

    @abc.abstractmethod
    def step(self, closure: Any = None) -> None:
        """At the accumulation boundary: overflow check, norm, unscale + clip, update, publish params."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None: ...

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds: keys `lp_params`, `grads`, `master_params`, `optimizer_states`, `total`."""


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values()
            if torch.is_tensor(value) and value.numel() > 1]
