"""What the engine reports: phase timers (`wall_clock_breakdown`), throughput, monitor events.

Kept apart from engine.py so sequencing and reporting do not mix. The timers and monitor writers
live in `zerospeed.utils.timer` and `zerospeed.monitor`; this module decides what is measured and
which events are written (DeepSpeed's `Train/Samples/*` tags plus grad norm, skipped steps,
samples/s, tokens/s and memory), at each accumulation boundary, on rank 0, against global_samples.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from zerospeed.utils.timer import SynchronizedWallClockTimer, ThroughputTimer

_BREAKDOWN_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# DeepSpeed's monitor tags for the timers: Train/Samples/elapsed_time_ms_<tag>.
_TIMER_TAGS = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner",
               "bwd_allreduce": "backward_allreduce", "step": "step"}


__all__ = ["EngineMonitoring", "MonitoredEngine"]


class MonitoredEngine(Protocol):
    """What monitoring reads of its engine: the counters, the step's lr / loss scale / norm, and the
    module the flops profiler measures (the engine itself is handed to the profiler, as DeepSpeed's)."""

    module: torch.nn.Module
    optimizer: Any
    global_steps: int
    global_samples: int
    skipped_steps: int

    def steps_per_print(self) -> int | None: ...

    def get_lr(self) -> list[float]: ...

    def fp16_enabled(self) -> bool: ...

    def was_step_applied(self) -> bool: ...

    def get_global_grad_norm(self) -> float | None: ...


class EngineMonitoring:
    def __init__(self, config: Any, train_batch_size: int, global_rank: int) -> None:
        self.config = config
        self.global_rank = global_rank
        self.breakdown = bool(config.wall_clock_breakdown)
        self.timers = SynchronizedWallClockTimer()
        throughput_config = getattr(config.model, "timers", None)
        synchronized = bool(getattr(getattr(throughput_config, "throughput", None), "synchronized", True))
        self.tput_timer = ThroughputTimer(batch_size=train_batch_size, steps_per_output=config.steps_per_print,
                                          synchronized=synchronized)
        self.monitor = self._build_monitor(config)
        self._loss_sum: torch.Tensor | None = None
        self._tokens_in_step = 0
        self.last_loss: float | None = None
        self.flops_profiler: Any = None
        self._profile_start_s = 0.0

    @staticmethod
    def _build_monitor(config: Any) -> Any:
        if not config.monitor_config.enabled:
            return None
        from zerospeed.monitor.monitor import MonitorMaster

        return MonitorMaster(config.monitor_config)

    # --- phases -------------------------------------------------------------------------------------
    def start(self, phase: str) -> None:
        if self.breakdown:
            self.timers(phase).start()
            self.timers(f"{phase}_microstep").start()

    def stop(self, phase: str) -> None:
        if self.breakdown:
            self.timers(f"{phase}_microstep").stop()
            self.timers(phase).stop()

    def on_forward(self, inputs: tuple, kwargs: dict) -> None:
        if not self.tput_timer.started:
            self.tput_timer.start()
        self._tokens_in_step += _token_count(inputs, kwargs)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Sum the micro-batch losses (already divided by GAS) into the step's mean loss."""
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    # --- boundaries ---------------------------------------------------------------------------------
    def on_micro_step_end(self, is_boundary: bool) -> None:
        self.tput_timer.stop(global_step=is_boundary, report_speed=is_boundary and self.global_rank == 0)

    def on_boundary(self, engine: MonitoredEngine) -> None:
        if self._loss_sum is not None:
            self.last_loss = float(self._loss_sum.float().item())
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write_events(self._events(engine))
        self.report_flops_profile()
        every = engine.steps_per_print()
        if self.breakdown and every and engine.global_steps % every == 0:
            self.timers.log([f"{name}_microstep" for name in _BREAKDOWN_TIMERS] + list(_BREAKDOWN_TIMERS),
                            memory_breakdown=bool(self.config.memory_breakdown))
        self._loss_sum = None
        self._tokens_in_step = 0

    def _events(self, engine: MonitoredEngine) -> list[tuple[str, float, int]]:
        step = engine.global_samples
        events = [("Train/Samples/lr", float(engine.get_lr()[0]), step),
                  ("Train/Samples/skipped_steps", float(engine.skipped_steps), step)]
        if self.last_loss is not None:
            events.append(("Train/Samples/train_loss", self.last_loss, step))
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", float(engine.optimizer.cur_scale), step))
        # A skipped (overflow) step keeps the last applied step's norm ([Note: one step]): not this step's.
        norm = engine.get_global_grad_norm()
        if engine.was_step_applied() and norm is not None:
            events.append(("Train/Samples/grad_norm", float(norm), step))
        events += self._throughput_events(step)
        if self.breakdown:
            events += [(f"Train/Samples/elapsed_time_ms_{_TIMER_TAGS[name]}", self.timers(name).elapsed(reset=False),
                        step) for name in _BREAKDOWN_TIMERS if self.timers.has(name)]
        return events

    def _throughput_events(self, step: int) -> list[tuple[str, float, int]]:
        from zerospeed.accelerator import get_accelerator

        events = [("Train/Samples/memory_allocated_bytes", float(get_accelerator().memory_allocated()), step)]
        samples_per_sec = self.tput_timer.avg_samples_per_sec()
        if samples_per_sec > 0:
            events.append(("Train/Samples/samples_per_sec", samples_per_sec, step))
            if self._tokens_in_step:
                tokens_per_sample = self._tokens_in_step / max(self.tput_timer.batch_size, 1)
                events.append(("Train/Samples/tokens_per_sec", samples_per_sec * tokens_per_sample, step))
        return events

    # --- flops profiler -----------------------------------------------------------------------------
    def profiling_this_step(self, engine: MonitoredEngine) -> bool:
        profiler_config = self.config.flops_profiler_config
        # Only the first micro-batch of the profiled step: its forward is what the report describes.
        return bool(profiler_config.enabled) and self.global_rank == 0 and self.flops_profiler is None and \
            engine.global_steps + 1 == profiler_config.profile_step

    def start_flops_profile(self, engine: MonitoredEngine) -> None:
        from zerospeed.profiling.flops_profiler import FlopsProfiler

        self.flops_profiler = FlopsProfiler(engine.module, engine,
                                            self.config.flops_profiler_config.recompute_fwd_factor)
        self._profile_start_s = time.perf_counter()
        self.flops_profiler.start_profile()

    def stop_flops_profile(self) -> None:
        if self.flops_profiler is not None:
            self.flops_profiler.stop_profile()

    def report_flops_profile(self) -> None:
        if self.flops_profiler is None:
            return
        profiler_config = self.config.flops_profiler_config
        self.flops_profiler.print_model_profile(
            profile_step=profiler_config.profile_step, module_depth=profiler_config.module_depth,
            top_modules=profiler_config.top_modules, detailed=profiler_config.detailed,
            output_file=profiler_config.output_file, step_latency_s=time.perf_counter() - self._profile_start_s)
        self.flops_profiler.end_profile()
        self.flops_profiler = None

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _token_count(inputs: tuple, kwargs: dict) -> int:
    """Tokens in a language-model micro-batch: the numel of the first integer tensor input."""
    for value in list(inputs) + list(kwargs.values()):
        if torch.is_tensor(value) and not value.is_floating_point():
            return value.numel()
    return 0
