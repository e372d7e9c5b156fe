"""The interface between the engine and every optimizer wrapper (stage 0, ZeRO 1/2, ZeRO 3).

[Note: engine / optimizer contract]
The engine owns sequencing (micro-steps, accumulation boundaries, the scheduler, logging); a
wrapper owns the tensors (low-precision params, gradients, fp32 masters, optimizer state) and all
gradient communication. Per micro-batch the engine calls

    wrapper.prepare_backward(will_reduce=is_boundary and not inside no_sync)
    scaled = wrapper.scale_loss(loss / gradient_accumulation_steps)
    scaled.backward()
    wrapper.backward_epilogue(is_boundary)       # skipped inside engine.no_sync()

and at the accumulation boundary `wrapper.step()` then `wrapper.zero_grad()`. The scheduler
drives `param_groups`, which are the base optimizer's.

[Note: stage dispatch]
The engine and `checkpoint/` never ask which stage they run: what differs between stages is a
method here that each wrapper answers (`trainable_param_groups`, `param_shapes`,
`saves_16bit_model`, `module_state_dict_16bit`, `consolidated_16bit_state_dict`,
`supports_no_sync`, `refresh_fp32_params`, `destroy`, the state dicts) or one of the checkpoint
half of the contract ([Note: checkpoint contract] in checkpoint/contract.py: the files a rank
writes, their layout, where the weights live, the resharded load). The factory
(optimizer_factory.py) is the one place that branches on the stage.
tests/runtime/test_optimizer_contract.py runs every wrapper through this contract.

[Note: one step]
`step()` is written once, here, for every stage; a stage supplies two things: its gradients
at the step (`_step_gradients`: whatever is still unreduced is reduced first; this rank's
tensors), and the update
(`_apply_update`: base optimizer on the masters, parameters made visible to the module). The
skeleton: overflow check -> loss-scaler update -> global norm -> unscale-and-clip multiplier (one
formula, `unscale_and_clip_factor`) -> update. Which ranks the flag and the norm's squares are
combined over is asked of the wrapper's `grad_space`, built once by the factory ([Note: gradient
space] in grad_space.py): ZeRO partitions, expert parts, tp-split elements, pipeline stages.

Two rules hold for every stage:
- Gradients are unscaled, and the reported norm divided, by the scale they were multiplied by:
  the loss scale *before* this step's `update_scale` (which may double it after a clean window).
- On an overflow the step is skipped and `get_global_grad_norm()` keeps the last applied step's
  norm (0.0 before any), as every DeepSpeed optimizer does (`stage_1_and_2.py::step`,
  `stage3.py::step`, `fp16/fused_optimizer.py::step` return before assigning it). The engine
  counts the skipped step and its monitor does not log the stale norm as that step's.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch

from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_space import DENSE, GradSpace, Piece
from zerospeed.runtime.grad_utils import unscale_and_clip_factor
from zerospeed.checkpoint.contract import OptimizerCheckpointing
from zerospeed.runtime.precision import PrecisionSettings

__all__ = ["NOT_PARTITIONED", "DeepSpeedOptimizer", "StepGradients", "optimizer_state_tensors", "tensor_bytes"]

NOT_PARTITIONED = ("consolidated_16bit_state_dict is only applicable where weights are partitioned "
                   "(ZeRO stage 3, or tensor parallelism under AutoTP)")


@dataclasses.dataclass
class StepGradients:
    """This rank's gradients at the step ([Note: one step]): the whole averaged vector at stage 0,
    this rank's partition at ZeRO 1-3 (which ranks hold the rest is the gradient space's to say).
    `comm_device` is where the flag and the squares are reduced when the gradients sit in host
    memory.
    """

    tensors: list[torch.Tensor]
    comm_device: torch.device | None = None


class DeepSpeedOptimizer(OptimizerCheckpointing):
    """Base of every zerospeed optimizer wrapper (DeepSpeed's name, so `isinstance` checks port)."""

    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    precision: PrecisionSettings
    clip_grad: float
    overflow: bool
    _global_grad_norm: float
    grad_space: GradSpace
    """Which ranks hold which parts of the step's gradients ([Note: gradient space])."""

    def _init_base(self, optimizer: torch.optim.Optimizer, loss_scaler: LossScaler,
                   precision: PrecisionSettings, grad_space: GradSpace) -> None:
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.precision = precision
        self.grad_space = grad_space
        self.clip_grad = float(precision.clip_grad)
        self.overflow = False
        self._global_grad_norm = 0.0   # DeepSpeed's optimizers start from 0.0 too

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

    def get_global_grad_norm(self) -> float:
        """The unscaled global gradient norm of the last applied step ([Note: one step])."""
        return self._global_grad_norm

    # --- the contract -----------------------------------------------------------------------
    def prepare_backward(self, will_reduce: bool) -> None:
        """Before each micro-batch's backward: whether its epilogue will reduce (the boundary, outside
        no_sync), so a wrapper can start reducing from gradient hooks while backward runs."""

    @abc.abstractmethod
    def backward_epilogue(self, is_boundary: bool) -> None:
        """After each micro-batch's backward: reduce / accumulate the gradients it produced."""

    def step(self, closure: Any = None) -> None:
        """At the accumulation boundary: [Note: one step]."""
        grads = self._step_gradients()
        scale = self.loss_scaler.cur_scale    # what the gradients carry; update_scale may change it
        self.overflow = self.precision.check_overflow and self.grad_space.overflow(grads.tensors, grads.comm_device)
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            self.zero_grad()
            return
        scaled_norm = self.grad_space.scaled_norm(self._norm_pieces(grads), grads.comm_device)
        self._global_grad_norm = scaled_norm / scale
        self._apply_update(grads.tensors, 1.0 / unscale_and_clip_factor(scaled_norm, scale, self.clip_grad))

    def _norm_pieces(self, grads: StepGradients) -> list[Piece]:
        """This rank's gradient elements, each tagged with its part of the gradient space: the whole
        tensors as one part, or, where the space splits tp parameters, their real elements by part."""
        if self.grad_space.splits_tensor_parallel:
            return self._tensor_parallel_norm_pieces(grads)
        return [(tensor, DENSE) for tensor in grads.tensors]

    def _tensor_parallel_norm_pieces(self, grads: StepGradients) -> list[Piece]:
        """This rank's real gradient elements (no padding), by part (stages 1-3 answer)."""
        raise NotImplementedError(f"{type(self).__name__} does not support tensor parallelism (AutoTP)")

    @abc.abstractmethod
    def _step_gradients(self) -> StepGradients:
        """Reduce what is still unreduced; this rank's gradients, still loss-scaled."""

    @abc.abstractmethod
    def _apply_update(self, grads: list[torch.Tensor], multiplier: float) -> None:
        """Multiply `grads` by `multiplier` (unscale and clip), step the masters, publish the params."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    # --- what the engine and the checkpoint code ask of every stage ([Note: stage dispatch]) ----
    supports_no_sync: bool = True
    """Whether gradients may accumulate unreduced inside `engine.no_sync()` (not with partitioned
    gradients: stages 2 and 3, as DeepSpeed)."""

    @abc.abstractmethod
    def trainable_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """The module's trainable parameters per group, in the order the wrapper lays them out
        (stage 0: per base-optimizer group; ZeRO 1/2: each group's flat order; stage 3: per sub-group)."""

    def param_shapes(self, param_names: dict[torch.nn.Parameter, str]) -> list[dict[str, torch.Size]]:
        """Per group of `trainable_param_groups`, name -> full shape (DeepSpeed's `param_shapes`)."""
        return [{param_names[p]: p.shape for p in group} for group in self.trainable_param_groups()]

    def saves_16bit_model(self) -> bool:
        """Whether `save_16bit_model` writes anything (stage 3: only when the config gathers)."""
        return True

    def module_state_dict_16bit(self, module: torch.nn.Module,
                                exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The full model-dtype state dict `save_16bit_model` writes; at stage 3 a collective whose
        result only rank 0 receives (None elsewhere), as DeepSpeed's."""
        state = module.state_dict()
        if exclude_frozen_parameters:
            for name, param in module.named_parameters():
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    def consolidated_16bit_state_dict(self, module: torch.nn.Module,
                                      exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The engine's `_consolidated_16bit_state_dict`: where weights are partitioned, the gathered
        full state dict (rank 0; None elsewhere); elsewhere DeepSpeed raises, and so do we."""
        raise ValueError(NOT_PARTITIONED)

    def destroy(self) -> None:
        """Remove the hooks this wrapper put on the module's parameters and release what it holds
        outside Python's reach (swap files), so that the model can be wrapped again."""

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
