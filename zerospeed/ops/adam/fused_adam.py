"""`FusedAdam`: DeepSpeed's GPU multi-tensor Adam, here torch's own fused/foreach Adam(W).

DeepSpeed builds `FusedAdam` when the optimizer is not offloaded. torch's `fused=True` Adam(W)
kernels already do that job on CUDA and CPU, so ours is a thin subclass with DeepSpeed's
constructor: `adam_w_mode=True` is AdamW, False is Adam with L2; `bias_correction=False` is not
offered by torch and is rejected; amsgrad is rejected as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Adam):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not support amsgrad=True")
        if not bias_correction:
            raise ValueError("FusedAdam here is torch's fused Adam, which always applies bias correction")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, fused=True)
        self.adam_w_mode = adam_w_mode
