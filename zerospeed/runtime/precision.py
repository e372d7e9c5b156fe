"""The precision and gradient-reduction settings every optimizer wrapper receives, resolved once.

Derived from the config by the engine (the `fp16`, `bf16`, `data_types` and `communication_data_type`
keys of `deepspeed/runtime/config.py::DeepSpeedConfig`, docs/config.md): the model dtype, the
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
    def from_config(cls, config: Any) -> PrecisionSettings:
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


def averaging_factors(settings: PrecisionSettings, world_size: int) -> tuple[float, float]:
    """(before, after) multipliers around a sum reduction under DeepSpeed's averaging rules
    (`deepspeed/runtime/engine.py::DeepSpeedEngine.allreduce_bucket`).

    Postscale (default): 1/f before, f/W after (f = gradient_predivide_factor); prescale: 1/W
    before; `gradient_average=False`: a plain sum. Split in two so an asynchronous reduction can
    apply the second factor after `wait()`.
    """
    if not settings.gradient_average:
        return 1.0, 1.0
    if settings.prescale_gradients:
        return 1.0 / world_size, 1.0
    factor = settings.gradient_predivide_factor
    return 1.0 / factor, (factor / world_size if factor != world_size else 1.0)


def average_in_place(flat: torch.Tensor, world_size: int, settings: PrecisionSettings, reduce: Any) -> None:
    """Reduce `flat` with `reduce(tensor)` (a synchronous sum collective) and average it."""
    before, after = averaging_factors(settings, world_size)
    if before != 1.0:
        flat.mul_(before)
    reduce(flat)
    if after != 1.0:
        flat.mul_(after)
