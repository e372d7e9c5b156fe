"""`HostGradientSink`: reduced gradient slices into host buffers while backward runs (ZeRO-Offload).

With `offload_optimizer` the step runs on the CPU and reads every gradient partition from host
memory. Rather than copy the partitions at the step, a ZeRO wrapper hands each reduced slice to
the sink as its reduction bucket completes (`add`: accumulate into the destination, `copy`:
replace it); the sink folds it into the host buffer while the rest of backward runs.

- A source already on the host (CPU-only machines, CI): no transfer, the host op is applied
  right away. It is the same queue as below, so CI runs the code the accelerator path runs.
- A source on an accelerator: a side stream first waits for the current (compute) stream, which
  produced the source, then copies it non_blocking into a pinned staging buffer and records an
  event. The pending entry holds the source until that event has completed: the caching
  allocator may hand a freed block to the next kernel of the compute stream while the side
  stream still reads it. The host op runs once the event has completed, found lazily at the
  next `add` / `copy` (the next bucket) or at `synchronize()`.

Invariants: pending entries complete in submission order, so contributions to one destination
are summed in the order a device-side accumulation would sum them (the same bits); a
destination is not read (nor written by anyone else) between a submission and the next
`synchronize()`, which the caller runs at the end of backward and before the step. At most
`max_pending` transfers are in flight, which bounds the staging memory.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from zerospeed.accelerator import get_accelerator

__all__ = ["HostGradientSink"]


@dataclasses.dataclass
class _Pending:
    dest: torch.Tensor
    values: torch.Tensor               # what the host op reads: the staging view, or a host source
    accumulate: bool
    source: torch.Tensor               # alive until the copy out of it has completed
    event: Any = None                  # None: nothing in flight, ready at once
    staging: torch.Tensor | None = None   # the whole pooled buffer `values` is a view of


class HostGradientSink:
    def __init__(self, pin_memory: bool = True, max_pending: int = 16) -> None:
        # Pinning only matters (and only works) with an accelerator: without it the D2H copy
        # into pageable memory is synchronous and nothing overlaps.
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.max_pending = max(1, int(max_pending))
        self._pending: collections.deque[_Pending] = collections.deque()
        self._free: list[torch.Tensor] = []          # staging buffers whose transfer is done
        self._streams: dict[torch.device, Any] = {}

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor to use as a destination (pinned when applicable)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin_memory)

    def add(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """`dest += source`, once the copy has landed; `dest` is a host tensor."""
        self._submit(dest, source, accumulate=True)

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """`dest[:] = source`, once the copy has landed; `dest` is a host tensor."""
        self._submit(dest, source, accumulate=False)

    def synchronize(self) -> None:
        """Wait for every transfer and apply every pending op: the destinations are final."""
        while self._pending:
            self._complete(self._pending.popleft(), wait=True)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # --- internals -----------------------------------------------------------------------------
    def _submit(self, dest: torch.Tensor, source: torch.Tensor, accumulate: bool) -> None:
        assert dest.device.type == "cpu", f"HostGradientSink destination must be a host tensor, got {dest.device}"
        assert dest.shape == source.shape, (tuple(dest.shape), tuple(source.shape))
        source = source.detach()
        if source.device.type == "cpu":
            entry = _Pending(dest, source, accumulate, source)
        else:
            entry = self._copy_to_host(dest, source, accumulate)
        self._pending.append(entry)   # behind any transfer in flight: submission order is kept
        self._complete_ready()

    def _copy_to_host(self, dest: torch.Tensor, source: torch.Tensor, accumulate: bool) -> _Pending:
        accelerator = get_accelerator()
        stream = self._stream_for(source.device)
        staging = self._take_staging(source.numel(), source.dtype)
        values = staging.narrow(0, 0, source.numel()).view(source.shape)
        stream.wait_stream(accelerator.current_stream(source.device.index))
        with accelerator.stream(stream):
            values.copy_(source, non_blocking=True)
            event = accelerator.Event()
            event.record(stream)
        return _Pending(dest, values, accumulate, source, event, staging)

    def _stream_for(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = get_accelerator().Stream(device=device)
        return stream

    def _complete_ready(self) -> None:
        """Apply the finished entries at the front; wait for the oldest beyond `max_pending`."""
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._complete(self._pending.popleft(), wait=False)
        while len(self._pending) > self.max_pending:
            self._complete(self._pending.popleft(), wait=True)

    def _complete(self, entry: _Pending, wait: bool) -> None:
        if wait and entry.event is not None:
            entry.event.synchronize()
        if entry.accumulate:
            entry.dest.add_(entry.values)
        else:
            entry.dest.copy_(entry.values)
        if entry.staging is not None:
            self._give_back(entry.staging)

    def _take_staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        fits = [b for b in self._free if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buffer = min(fits, key=lambda b: b.numel())
            self._free.remove(buffer)
            return buffer
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    def _give_back(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        if len(self._free) > self.max_pending:     # keep the pool bounded: drop the smallest
            self._free.remove(min(self._free, key=lambda b: b.numel()))
