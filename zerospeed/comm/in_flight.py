"""A bounded queue of asynchronous collectives, finished in the order they were issued.

[Note: in-flight collectives]
Gradient reducers overlap communication with backward by issuing each bucket's collective with
`async_op=True` and finishing it later: wait on the handle, then run the code that consumes the
result (scale, copy into the gradient partition). `max_outstanding` bounds how many may still be
in flight once `submit` returns; each one keeps its bucket's buffers alive, so the bound is also
the number of buckets of communication memory beside the one being filled. 0 makes every
collective synchronous (`overlap_comm` off). Only `wait()` is ever called on a handle: gloo's
asynchronous handles never report `is_completed()` and have no usable future.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["InFlightQueue"]


@dataclasses.dataclass
class _Work:
    handle: Any                            # the collective's work handle; None when it ran synchronously
    finish: Callable[[], None]             # consumes the result once the collective is done
    keepalive: tuple[Any, ...]             # buffers the collective reads or writes


class InFlightQueue:
    """Collectives in flight, at most `max_outstanding` after each `submit`, finished in order."""

    def __init__(self, max_outstanding: int) -> None:
        if max_outstanding < 0:
            raise ValueError(f"max_outstanding must be >= 0, got {max_outstanding}")
        self.max_outstanding = max_outstanding
        self._queue: collections.deque[_Work] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, handle: Any, finish: Callable[[], None], keepalive: tuple[Any, ...] = ()) -> None:
        """Track one issued collective; finish the oldest ones beyond the bound."""
        self._queue.append(_Work(handle, finish, keepalive))
        while len(self._queue) > self.max_outstanding:
            self._finish_oldest()

    def reserve(self, count: int) -> None:
        """Finish the oldest collectives until `count` more can be submitted within the bound (a
        caller about to reuse a buffer that an in-flight collective may still hold)."""
        while self._queue and len(self._queue) + count > self.max_outstanding:
            self._finish_oldest()

    def drain(self) -> None:
        """Finish every collective still in flight, oldest first."""
        while self._queue:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work = self._queue.popleft()
        if work.handle is not None:
            work.handle.wait()
        work.finish()
