"""`DeepSpeedCPUAdam`: Adam / AdamW on CPU parameters through the fused `cpu_adam` op.

DeepSpeed's constructor and state names (`step`, `exp_avg`, `exp_avg_sq`). `adamw_mode=True`
(the default) decays weights decoupled like torch.optim.AdamW; False adds L2 to the gradient
like torch.optim.Adam. Bias-correction scalars are computed here in double precision, exactly as
torch does, and handed to the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.ops.op_builder.cpu_adam import CPUAdamBuilder

__all__ = ["DeepSpeedCPUAdam"]


class DeepSpeedCPUAdam(CPUOptimizer):
    BUILDER = CPUAdamBuilder
    STATE_NAMES = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam does not support amsgrad=True (neither does DeepSpeed's)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode

    def _update_param(self, kernels: Any, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                      state: dict[str, Any], copy_out: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        step = state["step"]
        lr = group["lr"]
        step_size, bc2_sqrt = lr, 1.0
        if group["bias_correction"]:
            step_size = lr / (1 - beta1**step)
            bc2_sqrt = (1 - beta2**step) ** 0.5
        kernels.adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], lr, beta1, beta2,
                            group["eps"], group["weight_decay"], self.adam_w_mode, step_size, bc2_sqrt,
                            copy_out)
