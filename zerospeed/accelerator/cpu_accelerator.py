"""CPU accelerator: streams and events are no-ops, memory is the process's resident set."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psutil

from zerospeed.accelerator.abstract import Accelerator


class _NoopStream:
    """Stands in for a CUDA stream: work on CPU is already ordered."""

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        event = event or _CpuEvent()
        event.record()
        return event


class _CpuEvent:
    """An event that records the wall time, so `elapsed_time` works as on CUDA (milliseconds)."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._time_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time_s = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        assert self._time_s is not None and end._time_s is not None, "event not recorded"
        return (end._time_s - self._time_s) * 1000.0


class CPUAccelerator(Accelerator):
    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak_rss_bytes = 0

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # one host device whatever the index

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def Stream(self, *args: Any, **kwargs: Any) -> _NoopStream:  # noqa: N802
        return _NoopStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> _NoopStream:
        return _NoopStream()

    def default_stream(self, device_index: int | None = None) -> _NoopStream:
        return _NoopStream()

    def Event(self, *args: Any, **kwargs: Any) -> _CpuEvent:  # noqa: N802
        return _CpuEvent(*args, **kwargs)

    def memory_allocated(self, device_index: int | None = None) -> int:
        rss = psutil.Process().memory_info().rss
        self._peak_rss_bytes = max(self._peak_rss_bytes, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return max(self._peak_rss_bytes, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak_rss_bytes = 0

    def total_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().total

    def is_fp16_supported(self) -> bool:
        return True
