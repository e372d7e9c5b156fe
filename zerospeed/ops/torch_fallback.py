"""The fused kernels' math in plain torch: used when the C++ op cannot be built or loaded.

Each function has the signature of its C++ twin (`csrc/*/cpu_*.cpp`) and the same operation
order, so switching between them changes speed, not results (beyond torch's 1-ulp sqrt, see
docs/ops.md). They also accept any float dtype: the math runs in fp32 and is written back.
Readable first: this is the living documentation of what the kernels compute.
"""

from __future__ import annotations

import torch

__all__ = ["adagrad_update", "adam_update", "lion_update"]


def _copy_out(param: torch.Tensor, copy_out: torch.Tensor | None) -> None:
    if copy_out is not None:
        copy_out.copy_(param.reshape(copy_out.shape))


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                step_size: float, bc2_sqrt: float, copy_out: torch.Tensor | None = None) -> None:
    if weight_decay != 0:
        if adamw_mode:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    _copy_out(param, copy_out)


def adagrad_update(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, clr: float, eps: float,
                   weight_decay: float, copy_out: torch.Tensor | None = None) -> None:
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg_sq.addcmul_(grad, grad, value=1)
    param.addcdiv_(grad, exp_avg_sq.sqrt().add_(eps), value=-clr)
    _copy_out(param, copy_out)


def lion_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, lr: float, beta1: float,
                beta2: float, weight_decay: float, copy_out: torch.Tensor | None = None) -> None:
    update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    _copy_out(param, copy_out)
