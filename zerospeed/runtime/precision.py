"""The precision and gradient-reduction settings every optimizer wrapper receives, resolved once.

Derived from the config by the engine (reference §2.5-2.7, §3.9, §6.4): the model dtype, the
dtype gradients accumulate in (`data_types.grad_accum_dtype`, default the model dtype), the dtype
they are reduced in (`communication_data_type`, default the model dtype), clipping, the overflow
check and the averaging rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class PrecisionSettings:
    param_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    communication_dtype: torch.dtype = torch.float32
    clip_grad: float = 0.0
    check_overflow: bool = False
    gradient_average: bool = True          # gradient_allreduce_op == "mean"
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != torch.float32

    @classmethod
    def from_config(cls, config: Any) -> "PrecisionSettings":
        if config.fp16_enabled:
            param_dtype, check_overflow = torch.float16, True
        elif config.bf16_enabled:
            param_dtype, check_overflow = torch.bfloat16, bool(config.bf16.check_grad_overflow)
        else:
            param_dtype, check_overflow = torch.float32, False
        return cls(
            param_dtype=param_dtype,
            grad_accum_dtype=config.grad_accum_dtype or param_dtype,
            communication_dtype=config.communication_data_type or param_dtype,
            clip_grad=float(config.gradient_clipping or 0.0),
            check_overflow=check_overflow,
            gradient_average=config.gradient_allreduce_op == "mean",
            prescale_gradients=bool(config.prescale_gradients),
            gradient_predivide_factor=float(config.gradient_predivide_factor),
        )


def average_in_place(flat: torch.Tensor, world_size: int, settings: PrecisionSettings, reduce: Any) -> None:
    """Reduce `flat` with `reduce(tensor)` (a sum collective) under DeepSpeed's averaging rules (§3.9).

    Postscale (default): multiply by 1/f before, f/W after (f = gradient_predivide_factor);
    prescale: 1/W before. `gradient_average=False` is a plain sum.
    """
    if not settings.gradient_average:
        reduce(flat)
        return
    if settings.prescale_gradients:
        flat.mul_(1.0 / world_size)
        reduce(flat)
        return
    factor = settings.gradient_predivide_factor
    if factor != 1.0:
        flat.mul_(1.0 / factor)
    reduce(flat)
    if factor != world_size:
        flat.mul_(factor / world_size)
