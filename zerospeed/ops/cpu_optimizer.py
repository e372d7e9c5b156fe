"""`CPUOptimizer`: what DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and DeepSpeedCPULion share.

A subclass names its op builder and its state tensors and implements `_update_param`; this base
loads the kernels once, walks the param groups, creates state lazily and routes the optional
low-precision copy-out. Invariants:

* every parameter lives on the CPU (ZeRO-Offload's fp32 master copy), else ValueError;
* the C++ kernel runs when param, grad and states are contiguous fp32; anything else (bf16 params
  with `fp32_optimizer_states=False`, strided views, or no compiler at all) takes the torch
  implementation in `torch_fallback.py`, with identical math;
* [Note: copy-out] `step(fp16_param_groups=...)` (DeepSpeed's name) takes, per param group, a
  list of bf16/fp16 tensors shaped like that group's params; each receives its updated param,
  rounded to nearest-even, in the same pass over memory (offload copies those back to the GPU).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import torch

from zerospeed.ops import torch_fallback
from zerospeed.ops.op_builder.builder import OpBuilder

__all__ = ["CPUOptimizer", "load_kernels"]

_warned_ops: set[str] = set()


def load_kernels(builder: OpBuilder) -> tuple[ModuleType, bool]:
    """(module with the update functions, whether it is the native one). Never raises."""
    try:
        return builder.load(), True
    except Exception as error:  # no compiler, no ninja, failed build, ABI clash: all the same to us
        if builder.NAME not in _warned_ops:
            _warned_ops.add(builder.NAME)
            warnings.warn(f"zerospeed: the fused {builder.NAME} op is unavailable ({error}); using the "
                          "torch implementation instead (same results, slower). Run `zerospeed-report` "
                          "for details.", RuntimeWarning, stacklevel=3)
        return torch_fallback, False


class CPUOptimizer(torch.optim.Optimizer):
    BUILDER: type[OpBuilder]

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.device.type != "cpu":
                    raise ValueError(f"{type(self).__name__} needs CPU parameters, got one on {param.device}")
        self.fp32_optimizer_states = fp32_optimizer_states
        self._kernels, self.uses_native_kernels = load_kernels(self.BUILDER())

    # Subclass hooks -------------------------------------------------------------------------

    STATE_NAMES: tuple[str, ...] = ()

    def _update_param(self, kernels: Any, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                      state: dict[str, Any], copy_out: torch.Tensor | None) -> None:
        raise NotImplementedError

    def swap_state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors ZeRO-Offload's NVMe files hold after a param's master, in this order
        ([Note: unit files] in runtime/zero/offload/unit_files.py)."""
        return self.STATE_NAMES

    def initial_scalar_state(self, group: dict[str, Any]) -> dict[str, Any]:
        """A param's non-tensor state before its first step, as `_init_state` creates it."""
        return {"step": 0}

    # Shared machinery ---------------------------------------------------------------------------

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
        state["step"] = 0
        for name in self.STATE_NAMES:
            state[name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)

    def _kernels_for(self, tensors: Sequence[torch.Tensor]) -> Any:
        native = all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        return self._kernels if native else torch_fallback

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             fp16_param_groups: Sequence[Sequence[torch.Tensor] | torch.Tensor] | None = None) -> Any:
        """One update of every param with a grad; see [Note: copy-out] for `fp16_param_groups`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            copies = self._group_copies(fp16_param_groups, group_index, len(group["params"]))
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                state["step"] += 1
                copy_out = copies[param_index] if copies is not None else None
                self._update_one(group, param, state, copy_out)
        return loss

    def _update_one(self, group: dict[str, Any], param: torch.Tensor, state: dict[str, Any],
                    copy_out: torch.Tensor | None) -> None:
        grad = param.grad
        assert grad is not None
        tensors = [param.data, grad, *(state[name] for name in self.STATE_NAMES)]
        kernels = self._kernels_for(tensors)
        if all(t.dtype == torch.float32 for t in tensors):
            self._update_param(kernels, group, param.data, grad, state, copy_out)
            return
        # Low-precision params or states: the math runs on fp32 copies, rounded once on the way back.
        work_state = {**state, **{name: state[name].float() for name in self.STATE_NAMES}}
        work_param = param.data.float()
        self._update_param(torch_fallback, group, work_param, grad.float(), work_state, copy_out)
        param.data.copy_(work_param)
        for name in self.STATE_NAMES:
            state[name].copy_(work_state[name])

    @staticmethod
    def _group_copies(fp16_param_groups: Any, group_index: int, num_params: int) -> list[torch.Tensor] | None:
        if fp16_param_groups is None:
            return None
        copies = fp16_param_groups[group_index]
        copies = [copies] if isinstance(copies, torch.Tensor) else list(copies)
        if len(copies) != num_params:
            raise ValueError(f"fp16_param_groups[{group_index}] has {len(copies)} tensors, "
                             f"the param group {num_params}")
        return [c.view(-1) if c.is_contiguous() else c for c in copies]
