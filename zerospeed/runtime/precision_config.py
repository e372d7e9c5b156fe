"""The ``fp16`` and ``bf16`` (alias ``bfloat16``) ds_config sections.

fp16 ``loss_scale == 0`` means dynamic loss scaling; `DeepSpeedFP16Config.dynamic_loss_scale_args`
is the dict the loss scaler is built from (`deepspeed/runtime/fp16/loss_scaler.py::CreateLossScaler`). Loss-scaling knobs written into the
``bf16`` block (a common copy-paste from an fp16 config, which DeepSpeed rejects) are accepted
with a warning and ignored: bf16 never scales the loss.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel, Deprecated

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config"]


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    enabled: bool = False
    """Cast params to half and train with loss scaling."""
    auto_cast: bool = False
    """Cast floating-point forward inputs to half (recursing into lists, tuples and dicts)."""
    loss_scale: float = 0.0
    """0: dynamic loss scaling; > 0: a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (the scaler's `delayed_shift`)."""
    consecutive_hysteresis: bool = False
    """Refill hysteresis on every clean step instead of only when the scale grows."""
    min_loss_scale: int = 1
    """Floor of the dynamic scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights in fp16 (ZeRO 1-3 with CPU offload only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_is_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("loss_scale must be a number, not a bool")  # noqa: TRY004 (pydantic wants ValueError)
        return value

    @model_validator(mode="after")
    def _check_scaling(self) -> DeepSpeedFP16Config:
        if not math.isfinite(self.loss_scale) or self.loss_scale < 0:
            raise ValueError(f"loss_scale must be finite and >= 0, got {self.loss_scale}")
        if self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(f"loss_scale_window must be > 0 with dynamic scaling, got {self.loss_scale_window}")
            if self.min_loss_scale <= 0:
                raise ValueError(f"min_loss_scale must be > 0 with dynamic scaling, got {self.min_loss_scale}")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {self.hysteresis}")
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)

    @property
    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        """The loss scaler's arguments (DeepSpeed's `dynamic_loss_args`), or None for a static scale or fp16 off."""
        if not (self.enabled and self.dynamic_loss_scale):
            return None
        return {
            "init_scale": self.initial_dynamic_scale,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }


_IGNORED_UNDER_BF16 = "Loss scaling is fp16-only; bf16 does not scale the loss."


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    deprecated_keys: ClassVar[dict[str, Deprecated]] = {
        key: Deprecated(None, note=_IGNORED_UNDER_BF16)
        for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "consecutive_hysteresis", "min_loss_scale", "auto_cast")
    }

    enabled: bool = False
    """bf16 params (fp32 master weights unless bf16_master_weights_and_grads)."""
    immediate_grad_update: bool = False
    """Accumulate into the fp32 grad buffer from per-parameter hooks, not in the backward epilogue."""
    check_grad_overflow: bool = True
    """ZeRO-1/2: check bf16 grads for inf/nan and skip the step if found."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights in bf16 (ZeRO 1-3 only)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer moments in bf16; requires bf16_master_weights_and_grads."""

    @model_validator(mode="after")
    def _states_need_master(self) -> DeepSpeedBF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states requires bf16_master_weights_and_grads")
        return self
