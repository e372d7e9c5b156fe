"""What the engine reports: phase timers (`wall_clock_breakdown`), monitor events, throughput.

Kept apart from engine.py so sequencing and reporting do not mix. The timers and monitor writers
themselves live in `zerospeed.utils.timer` and `zerospeed.monitor`.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class EngineMonitoring:
    def __init__(self, config: Any, train_batch_size: int) -> None:
        self.config = config
        self.train_batch_size = train_batch_size
        self._phase_start_s: dict[str, float] = {}
        self.phase_totals_s: dict[str, float] = {}
        self._loss_sum: torch.Tensor | None = None
        self.last_loss: float | None = None
        self._last_boundary_s: float | None = None
        self.last_samples_per_sec: float | None = None

    def start(self, phase: str) -> None:
        if self.config.wall_clock_breakdown:
            self._phase_start_s[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.config.wall_clock_breakdown and phase in self._phase_start_s:
            elapsed = time.perf_counter() - self._phase_start_s.pop(phase)
            self.phase_totals_s[phase] = self.phase_totals_s.get(phase, 0.0) + elapsed

    def record_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> None:
        """Sum the micro-batch losses (already divided by GAS) into the step's mean loss."""
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def on_boundary(self, engine: Any) -> None:
        if self._loss_sum is not None:
            self.last_loss = float(self._loss_sum.item())
            self._loss_sum = None
        now_s = time.perf_counter()
        if self._last_boundary_s is not None:
            self.last_samples_per_sec = self.train_batch_size / max(now_s - self._last_boundary_s, 1e-9)
        self._last_boundary_s = now_s
