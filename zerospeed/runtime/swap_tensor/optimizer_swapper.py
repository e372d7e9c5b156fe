"""`OptimizerSwapper`: optimizer swap units on NVMe through a bounded pool of staging buffers.

A swap unit is one chunk of an fp32 master partition together with its optimizer states
(`num_tensors` fp32 tensors of the same numel: master, exp_avg, exp_avg_sq for Adam). On disk it
is one file, `unit_<id>.swp`, tensor t at byte `t * aligned_bytes(4 * numel)`; in RAM it only
exists while it sits in one of `buffer_count` staging buffers, each sized for the largest unit.
So the optimizer state resident in RAM is bounded by `buffer_count * buffer_bytes`, whatever
the model size. Buffers are 4 KiB aligned and units span whole aligned slots, so every unit
transfer goes through O_DIRECT (aio_engine [Note: O_DIRECT]). `create_fast` (`fast_init`) writes
only a new unit's master and leaves its zero states as a file hole.

[Note: read-ahead / write-behind]
The step walks the units in order. `prefetch(uid)` starts reading a unit if a buffer is free
(it never blocks); `swap_in(uid)` waits for that read, or takes a buffer (waiting for a write to
finish if none is free, else taking back the furthest read-ahead) and reads. `swap_out(uid)` starts writing the buffer back and returns at
once; the buffer returns to the pool when the write completes. A unit's read waits for its own
pending write, so it never sees stale bytes. With 3 or more buffers the optimizer works on unit
k while k+1 is read and k-1 written.

Files live in a private directory under `nvme_path`, removed by `close()`, when the swapper is
garbage collected, or at interpreter exit (`weakref.finalize`).
"""

from __future__ import annotations

import os
import shutil
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

from zerospeed.runtime.swap_tensor.aio_engine import AsyncIOEngine, aligned_bytes, aligned_empty

__all__ = ["OptimizerSwapper", "StagingBuffers"]

_DTYPE = torch.float32
_ELEMENT_BYTES = 4


def aligned_numel(numel: int) -> int:
    return aligned_bytes(numel * _ELEMENT_BYTES) // _ELEMENT_BYTES


class StagingBuffers:
    """`count` flat fp32 buffers of `numel` elements (pinned when asked and CUDA is present), each
    starting at an `ALIGNMENT`-aligned address so unit transfers go through O_DIRECT."""

    def __init__(self, count: int, numel: int, pin_memory: bool) -> None:
        if count < 1:
            raise ValueError("offload_optimizer.buffer_count must be >= 1 for device 'nvme'")
        pin = pin_memory and torch.cuda.is_available()
        self.buffers = [aligned_empty(numel, _DTYPE, pin_memory=pin) for _ in range(count)]
        self._free = list(range(count))
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def try_acquire(self) -> int | None:
        with self._cond:
            return self._free.pop(0) if self._free else None

    def acquire(self) -> int:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            return self._free.pop(0)

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify()


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class OptimizerSwapper:
    def __init__(self, swap_dir: str, num_tensors: int, max_unit_numel: int, buffer_count: int,
                 aio: AsyncIOEngine, pin_memory: bool) -> None:
        os.makedirs(swap_dir, exist_ok=True)
        self.swap_dir = swap_dir
        self.num_tensors = num_tensors
        self.slot_numel = aligned_numel(max_unit_numel)
        self.aio = aio
        self.pool = StagingBuffers(buffer_count, num_tensors * self.slot_numel, pin_memory)
        self._numel: dict[int, int] = {}
        self._reads: dict[int, tuple[int, Future]] = {}    # uid -> (buffer, read future)
        self._writes: dict[int, Future] = {}
        self._held: dict[int, int] = {}                     # uid -> buffer, swapped in
        self._writing: set[int] = set()                     # buffers being written back
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_dir, swap_dir)

    # --- layout ---------------------------------------------------------------------------------
    def path(self, uid: int) -> str:
        return os.path.join(self.swap_dir, f"unit_{uid:06d}.swp")

    def _span(self, buffer: int, numel: int) -> torch.Tensor:
        """The bytes of a unit of `numel`: `num_tensors` aligned slots, end to end."""
        return self.pool.buffers[buffer].narrow(0, 0, self.num_tensors * aligned_numel(numel))

    def _views(self, buffer: int, numel: int) -> list[torch.Tensor]:
        stride = aligned_numel(numel)
        flat = self.pool.buffers[buffer]
        return [flat.narrow(0, t * stride, numel) for t in range(self.num_tensors)]

    # --- the unit life cycle -----------------------------------------------------------------------
    def create(self, uid: int, tensors: list[torch.Tensor]) -> None:
        """Write a new unit (synchronously): `tensors` are its master and states, same numel."""
        numel = tensors[0].numel()
        self._numel[uid] = numel
        buffer = self.pool.acquire()
        try:
            for view, tensor in zip(self._views(buffer, numel), tensors):
                view.copy_(tensor.reshape(-1))
            self.aio.write(self.path(uid), self._span(buffer, numel))
        finally:
            self.pool.release(buffer)

    def create_fast(self, uid: int, master: torch.Tensor) -> None:
        """`offload_optimizer.fast_init`: a new unit whose states are zeros, without writing them.

        Only the master slot is written; the file is sized to the whole unit with `ftruncate`, and
        the filesystem reads the hole back as zeros."""
        numel = master.numel()
        self._numel[uid] = numel
        fd = os.open(self.path(uid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.num_tensors * aligned_bytes(numel * _ELEMENT_BYTES))
        finally:
            os.close(fd)
        buffer = self.pool.acquire()
        try:
            self._views(buffer, numel)[0].copy_(master.reshape(-1))
            self.aio.write(self.path(uid), self.pool.buffers[buffer].narrow(0, 0, aligned_numel(numel)))
        finally:
            self.pool.release(buffer)

    def prefetch(self, uid: int) -> bool:
        """Start reading `uid` if a buffer is free; False when none is (never blocks)."""
        if uid in self._reads or uid in self._held:
            return True
        buffer = self.pool.try_acquire()
        if buffer is None:
            return False
        self._start_read(uid, buffer)
        return True

    def _start_read(self, uid: int, buffer: int) -> None:
        pending = self._writes.pop(uid, None)
        if pending is not None:
            pending.result()
        future = self.aio.submit_read(self.path(uid), self._span(buffer, self._numel[uid]))
        self._reads[uid] = (buffer, future)

    def swap_in(self, uid: int) -> list[torch.Tensor]:
        """The unit's tensors (views into a staging buffer), after its read completes."""
        if uid in self._held:
            return self._views(self._held[uid], self._numel[uid])
        if uid not in self._reads:
            self._start_read(uid, self._take_buffer())
        buffer, future = self._reads.pop(uid)
        future.result()
        self._held[uid] = buffer
        return self._views(buffer, self._numel[uid])

    def _take_buffer(self) -> int:
        """A free buffer: wait for a write to finish, else take back the furthest read-ahead."""
        with self._lock:
            buffer = self.pool.try_acquire()
            writing = bool(self._writing)
        if buffer is not None:
            return buffer
        if writing:
            return self.pool.acquire()      # a write completes and frees its buffer
        if not self._reads:
            raise RuntimeError(f"all {len(self.pool.buffers)} staging buffers are swapped in; swap_out first")
        buffer, future = self._reads.pop(next(reversed(self._reads)))
        future.result()
        return buffer

    def _write_done(self, buffer: int) -> None:
        with self._lock:
            self._writing.discard(buffer)
            self.pool.release(buffer)

    def swap_out(self, uid: int, dirty: bool = True) -> None:
        """Write the unit back behind the caller's back; its buffer is freed when the write ends."""
        buffer = self._held.pop(uid)
        if not dirty:
            self.pool.release(buffer)
            return
        with self._lock:
            self._writing.add(buffer)
        future = self.aio.submit_write(self.path(uid), self._span(buffer, self._numel[uid]))
        future.add_done_callback(lambda _: self._write_done(buffer))
        self._writes[uid] = future

    def update(self, uid: int, fn: Callable[[list[torch.Tensor]], None]) -> None:
        """Read-modify-write of one unit (checkpoint load)."""
        fn(self.swap_in(uid))
        self.swap_out(uid)

    def flush(self) -> None:
        """Wait for every write; re-raises an I/O error."""
        writes, self._writes = self._writes, {}
        for future in writes.values():
            future.result()

    # --- accounting / cleanup ---------------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        return self.pool.nbytes

    def resident_unit_bytes(self) -> int:
        """Bytes of unit tensors currently swapped in (held or being read)."""
        uids = list(self._held) + list(self._reads)
        return sum(self.num_tensors * self._numel[uid] * _ELEMENT_BYTES for uid in uids)

    def file_bytes(self) -> int:
        return sum(os.path.getsize(self.path(uid)) for uid in self._numel if os.path.exists(self.path(uid)))

    def close(self) -> None:
        for _buffer, future in self._reads.values():
            future.result()
        self._reads.clear()
        self.flush()
        self.aio.shutdown()
        self._finalizer()
