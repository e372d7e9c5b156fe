"""Rank side of the hang report: where this rank is with its collectives, and a stack on demand.

[Note: hang report]
The launcher gives every rank a small file (``ZS_HEARTBEAT_FILE``). When it is set, importing
zerospeed maps the file and registers ``faulthandler`` on SIGUSR2 (every thread's Python stack to
``<file>.stack``); every collective of ``zerospeed.comm`` (and every ``wait()`` on an async one)
records in the file that the rank is inside a collective, since when, and which one, and counts
the collectives it completed. That costs a few memory writes per collective.

The launcher (``hang.py``) reads the files. When a rank has waited in one collective for longer
than ``ZS_HANG_TIMEOUT_S`` (default 300 s, half of the 10-minute process-group timeout), it
signals every rank for its stack, prints the stacks, names the ranks that are *not* in a
collective (the ones the others wait for), and ends the job with exit code 124. A long step in
which no rank waits in a collective never trips it, however long it is.
Without the launcher (no ``ZS_HEARTBEAT_FILE``) every function here is a no-op.
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import time
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["HEARTBEAT_ENV", "LAYOUT", "STACK_SIGNAL", "collective", "install", "read_state", "track_work"]

HEARTBEAT_ENV = "ZS_HEARTBEAT_FILE"
STACK_SIGNAL = signal.SIGUSR2
# completed collectives, depth inside collectives, entered at (time.time()), pid of the process that
# owns the file (0 until one has mapped it), op name
LAYOUT = struct.Struct("<qqdq32s")

_map: mmap.mmap | None = None
_stack_file: IO[str] | None = None
_completed = 0
_depth = 0


def install() -> None:
    """Map the heartbeat file and register the stack dump; a no-op without the launcher."""
    global _map, _stack_file
    path = os.environ.get(HEARTBEAT_ENV)
    if _map is not None or not path:
        return
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        if LAYOUT.unpack_from(mapped, 0)[3]:
            # Already owned: this is a process the rank started (a spawned data-loader worker
            # importing zerospeed) and inherited the environment; the heartbeat stays the rank's.
            mapped.close()
            return
        _map = mapped
        _stack_file = open(f"{path}.stack", "w")  # noqa: SIM115 - faulthandler writes to it until exit
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):  # the file went away: no hang report for this rank
        _map = None
        return
    _write(b"")


def _write(op: bytes) -> None:
    assert _map is not None
    LAYOUT.pack_into(_map, 0, _completed, _depth, time.time() if _depth else 0.0, os.getpid(), op[:32])


@contextlib.contextmanager
def collective(op: str) -> Iterator[None]:
    """Mark the rank as inside collective `op` for the duration of the block."""
    global _completed, _depth
    if _map is None:
        yield
        return
    _depth += 1
    if _depth == 1:
        _write(op.encode())
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _completed += 1
            _write(b"")


class _TrackedWork:
    """An async collective's handle whose ``wait()`` counts as being inside the collective."""

    def __init__(self, work: Any, op: str) -> None:
        self._work, self._op = work, op

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with collective(self._op):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def track_work(result: Any, op: str) -> Any:
    """Wrap the handle an ``async_op=True`` collective returned (anything else passes through)."""
    if _map is None or result is None or not hasattr(result, "wait"):
        return result
    return _TrackedWork(result, op)


def read_state(path: str) -> dict[str, Any] | None:
    """The launcher's view of one rank's file (None before the rank has mapped it)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(LAYOUT.size)
    except OSError:
        return None
    if len(data) < LAYOUT.size:
        return None
    completed, depth, entered_at, pid, op = LAYOUT.unpack(data)
    if not pid:
        return None
    return {"completed": completed, "inside": depth > 0, "entered_at": entered_at, "pid": pid,
            "op": op.rstrip(b"\0").decode(errors="replace")}
