"""`DeepSpeedCPUAdagrad`: Adagrad on CPU parameters through the fused `cpu_adagrad` op.

DeepSpeed's constructor; the squared-gradient sum is stored as `exp_avg_sq` (DeepSpeed's name).
Weight decay is L2 (added to the gradient), as in torch.optim.Adagrad.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.ops.op_builder.cpu_adagrad import CPUAdagradBuilder

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(CPUOptimizer):
    BUILDER = CPUAdagradBuilder
    STATE_NAMES = ("exp_avg_sq",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0, amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not support amsgrad=True")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         fp32_optimizer_states)

    def _update_param(self, kernels: Any, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                      state: dict[str, Any], copy_out: torch.Tensor | None) -> None:
        kernels.adagrad_update(param, grad, state["exp_avg_sq"], group["lr"], group["eps"],
                               group["weight_decay"], copy_out)
