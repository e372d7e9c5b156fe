"""LAMB (You et al., 2019) with DeepSpeed's `FusedLamb` signature, in torch.

Per parameter: Adam moments, an update `u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`, and a
layer-wise trust ratio `||p|| / ||u||` clamped to [min_coeff, max_coeff] that scales the step.
`max_grad_norm` > 0 first clips the gradients by their global norm. The trust ratio needs each
parameter whole, so LAMB is not an element-wise optimizer: under ZeRO's flat partitions it would
see slices, which is why the engine refuses it at stages 1-3 unless `zero_allow_untested_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class FusedLamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedLamb does not support the AMSGrad variant")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        self.lamb_coeffs = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            clip = _clip_factor(params, group["max_grad_norm"])
            for param in params:
                self.lamb_coeffs.append(self._update(param, group, clip))
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any], clip: float) -> float:
        dtype = torch.promote_types(param.dtype, torch.float32)  # low precision computes in fp32
        assert param.grad is not None, "only parameters with a gradient are updated"
        grad = param.grad.to(dtype) * clip
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            m_hat = exp_avg / (1 - beta1 ** state["step"])
            v_hat = exp_avg_sq / (1 - beta2 ** state["step"])
        else:
            m_hat, v_hat = exp_avg, exp_avg_sq
        denom = (v_hat + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt() + group["eps"]
        update = m_hat / denom
        if group["weight_decay"] != 0:
            update.add_(param.to(dtype), alpha=group["weight_decay"])
        weight_norm, update_norm = param.to(dtype).norm().item(), update.norm().item()
        coeff = 1.0 if weight_norm == 0 or update_norm == 0 else weight_norm / update_norm
        coeff = min(max(coeff, group["min_coeff"]), group["max_coeff"])
        param.add_(update.to(param.dtype), alpha=-group["lr"] * coeff)
        return coeff


def _clip_factor(params: list[torch.Tensor], max_grad_norm: float) -> float:
    if max_grad_norm <= 0 or not params:
        return 1.0
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params
                                                  if p.grad is not None]))
    return min(1.0, max_grad_norm / (float(total) + 1e-6))
