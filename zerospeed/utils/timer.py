"""Wall-clock timers for `wall_clock_breakdown` and the throughput log line (DeepSpeed's
`deepspeed/utils/timer.py::SynchronizedWallClockTimer`, `ThroughputTimer`).

`SynchronizedWallClockTimer` holds named timers. Each `start()` / `stop()` synchronizes the
accelerator first, so a timer measures the device work queued inside its interval, not just the
host's launch time; elapsed time accumulates across start/stop pairs until it is read with
`elapsed(reset=True)`. Times are reported in milliseconds, as DeepSpeed's are (the engine writes
them to the monitor as `Train/Samples/elapsed_time_ms_*`).

The engine's timer names are DeepSpeed's: `fwd, bwd, bwd_inner, bwd_allreduce, step` for a whole
accumulation window and the same names with `_microstep` for one micro-batch.

`ThroughputTimer` measures samples per second over global steps, skipping the first `start_step`
steps (warm-up) as DeepSpeed does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from zerospeed.utils.logging import logger, print_dist

__all__ = [
    "SynchronizedWallClockTimer", "ThroughputTimer", "FORWARD_MICRO_TIMER", "FORWARD_GLOBAL_TIMER",
    "BACKWARD_MICRO_TIMER", "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER", "BACKWARD_REDUCE_GLOBAL_TIMER",
    "STEP_MICRO_TIMER", "STEP_GLOBAL_TIMER",
]

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"


def _synchronize() -> None:
    from zerospeed.accelerator import get_accelerator

    get_accelerator().synchronize()


class _Timer:
    """One named interval timer; accumulates milliseconds over start/stop pairs."""

    def __init__(self, name: str, synchronize: Callable[[], None]) -> None:
        self.name = name
        self._synchronize = synchronize
        self.started = False
        self._start_s = 0.0
        self._elapsed_ms = 0.0
        self._records_ms: list[float] = []

    def start(self) -> None:
        if self.started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._synchronize()
        self._start_s = time.perf_counter()
        self.started = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the interval; `record` keeps it for `mean()`, `reset` drops what accumulated before."""
        if not self.started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._synchronize()
        interval_ms = (time.perf_counter() - self._start_s) * 1000.0
        self._elapsed_ms = interval_ms if reset else self._elapsed_ms + interval_ms
        if record:
            self._records_ms.append(interval_ms)
        self.started = False

    def reset(self) -> None:
        self.started = False
        self._elapsed_ms = 0.0
        self._records_ms.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated milliseconds (including a running interval); `reset` clears the total."""
        running = self.started
        if running:
            self.stop()
        elapsed_ms = self._elapsed_ms
        if reset:
            self._elapsed_ms = 0.0
        if running:
            self.start()
        return elapsed_ms

    def mean(self) -> float:
        """Mean milliseconds of the recorded intervals (0.0 when none)."""
        return sum(self._records_ms) / len(self._records_ms) if self._records_ms else 0.0


class SynchronizedWallClockTimer:
    """Named timers: `timers("fwd").start()`, `.stop()`, `.elapsed(reset)`, `timers.log([...])`."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.timers: dict[str, _Timer] = {}
        self._synchronize = synchronize or _synchronize

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name, self._synchronize)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    def has(self, name: str) -> bool:
        return name in self.timers

    def format(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """DeepSpeed's line: `time (ms) | fwd_microstep: 1.23 | bwd_microstep: 4.56`."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        return line

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool | None = None, ranks: list[int] | None = None) -> None:
        """Print the line on `ranks` (default rank 0); unknown names are left out."""
        line = self.format(names, normalizer, reset)
        if memory_breakdown:
            line += " | " + _memory_usage()
        print_dist(line, ranks=ranks if ranks is not None else [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        means = {name: self.timers[name].mean() / normalizer for name in names if name in self.timers}
        if reset:
            for name in means:
                self.timers[name].reset()
        return means


def _memory_usage() -> str:
    from zerospeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    gib = 1024**3
    return (f"mem_allocated: {accelerator.memory_allocated() / gib:.4f} GB | "
            f"max_mem_allocated: {accelerator.max_memory_allocated() / gib:.4f} GB")


class ThroughputTimer:
    """Samples/s over global steps: `start()` before a micro-batch, `stop(global_step, report_speed)` after.

    The first `start_step` global steps are not timed (warm-up). The running average is
    `batch_size / (total_time / (global_steps - start_step))`; the current rate is the last global
    step's. Every `steps_per_output` global steps (when `report_speed`) the DeepSpeed line
    `epoch=.../micro_step=.../global_step=..., RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...,
    MemAllocated=...GB, MaxMemAllocated=...GB` goes to `logging_fn` (default `logger.info`).
    """

    def __init__(self, batch_size: int, steps_per_output: int | None = None, start_step: int = 2,
                 synchronized: bool = True, monitor_memory: bool = False,
                 logging_fn: Callable[[str], None] | None = None) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.steps_per_output = steps_per_output
        self.start_step = start_step
        self.synchronized = synchronized
        self.monitor_memory = monitor_memory
        self.logging_fn = logging_fn or logger.info
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over timed global steps
        self.step_elapsed_time = 0.0   # seconds, in the current global step
        self.started = False
        self._start_s = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _sync(self) -> None:
        if self.synchronized:
            _synchronize()

    def start(self) -> None:
        self.started = True
        self._start_s = 0.0
        if self.global_step_count >= self.start_step:
            self._sync()
            self._start_s = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self._start_s > 0.0:
            self._sync()
            duration_s = time.perf_counter() - self._start_s
            self.total_elapsed_time += duration_s
            self.step_elapsed_time += duration_s
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self.logging_fn(self.format_line())
                self.step_elapsed_time = 0.0

    def format_line(self) -> str:
        from zerospeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        current = self.batch_size / self.step_elapsed_time if self.step_elapsed_time > 0 else float("nan")
        line = (f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                f"global_step={self.global_step_count}, "
                f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, CurrSamplesPerSec={current}, "
                f"MemAllocated={round(accelerator.memory_allocated() / 1024**3, 2)}GB, "
                f"MaxMemAllocated={round(accelerator.max_memory_allocated() / 1024**3, 2)}GB")
        if self.monitor_memory:
            import psutil

            virtual = psutil.virtual_memory()
            line += f", UsedMem={round(virtual.used / 1024**3, 2)}GB, Percent={virtual.percent}%"
        return line

    def avg_samples_per_sec(self) -> float:
        """Samples/s averaged over the timed global steps; -inf before any step was timed."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")

    def avg_tokens_per_sec(self, seq_length: int) -> float:
        """Tokens/s for fixed-length samples (`seq_length` tokens each)."""
        return self.avg_samples_per_sec() * seq_length
