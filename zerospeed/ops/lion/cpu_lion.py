"""`DeepSpeedCPULion`: Lion on CPU parameters through the fused `cpu_lion` op.

DeepSpeed's constructor; the momentum is stored as `exp_avg`. Weight decay is decoupled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.ops.op_builder.cpu_lion import CPULionBuilder

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(CPUOptimizer):
    BUILDER = CPULionBuilder
    STATE_NAMES = ("exp_avg",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
                         fp32_optimizer_states)

    def _update_param(self, kernels: Any, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                      state: dict[str, Any], copy_out: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        kernels.lion_update(param, grad, state["exp_avg"], group["lr"], beta1, beta2, group["weight_decay"],
                            copy_out)
