"""Static and dynamic loss scaling, shared by every stage (DeepSpeed's algorithm,
`deepspeed/runtime/fp16/loss_scaler.py::DynamicLossScaler.update_scale`).

[Note: dynamic loss scaling]
`update_scale(overflow)` runs once per optimizer step. An overflow first spends hysteresis
(`delayed_shift`): only when one tolerated overflow is left does the scale halve (never below
`min_scale`; an overflow *at* the minimum stops the run). A clean run of `scale_window` steps since
the last overflow doubles the scale and refills hysteresis; with `consecutive_hysteresis` every
clean step refills it. bf16 and fp32 use a static scale of 1.0, so the same calls cost nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.utils.logging import logger


class LossScaleAtMinimumError(RuntimeError):
    """fp16 overflowed with the loss scale already at `min_loss_scale`."""


class LossScaler:
    """A constant scale (fp16 with a static `loss_scale`; 1.0 for bf16 / fp32)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "dynamic": False}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler(LossScaler):
    dynamic = True

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0,
                 delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True, scale_factor: float = 2.0) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(
                    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
                    f"(fp16 overflowed at min_loss_scale={self.min_scale}: try bf16, a lower learning "
                    "rate, gradient_clipping, or a smaller fp16.min_loss_scale.)")
            new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.warning("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                           self.cur_scale, new_scale)
            self.cur_scale = new_scale
        else:
            logger.warning("OVERFLOW! Skipping step. Attempted loss scale: %s, but hysteresis is %d. "
                           "Reducing hysteresis to %d", self.cur_scale, self.cur_hysteresis,
                           self.cur_hysteresis - 1)
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_steps = self.cur_iter - self.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    _STATE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
                   "min_scale", "delayed_shift", "cur_hysteresis", "consecutive_hysteresis")

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {key: getattr(self, key) for key in self._STATE_KEYS}
        state["dynamic"] = True
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self._STATE_KEYS:
            if key in state:
                setattr(self, key, state[key])


def create_loss_scaler(dtype: torch.dtype, static_loss_scale: float = 1.0, dynamic_scaling: bool = False,
                       dynamic_loss_args: dict[str, Any] | None = None) -> LossScaler:
    """DeepSpeed's `CreateLossScaler`: dynamic only for fp16 with dynamic scaling, else a constant."""
    if dtype != torch.float16:
        return LossScaler(1.0)
    if not dynamic_scaling:
        return LossScaler(static_loss_scale)
    return DynamicLossScaler(**(dynamic_loss_args or {}))
