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
The step walks the units in order. `prefetch(uid)` starts reading a unit if a buffer can be had
without waiting; `swap_in(uid)` waits for that read, or claims a buffer (taking back the furthest
read-ahead if every buffer is busy) and reads. With 3 or more buffers the optimizer works on
unit k while k+1 is read and k-1 written. A unit's read waits for its own pending write, so it
never sees stale bytes.

[Note: staging buffers as a write-back cache]
`swap_out(uid)` does not write at once: the unit stays in its buffer, cached (dirty when the
caller changed it), and is written back only when its buffer is claimed for another unit. The
write-back and the read that follows into the same buffer are one `submit_chain` task, so
neither blocks the caller. A buffer is claimed free first, else from the least recently released
unit of the current pass (`begin_pass`): a read-ahead never evicts a unit the pass has yet to
reach. With a sweep that alternates direction each step (offload_states.py, [Note: alternating
sweep]) the units stepped last are the first ones needed next, already in their buffers: per step
the disk sees `units - buffer_count` reads and as many writes, instead of `units` each way, and
none at all when every unit fits in the buffers. RAM stays bounded by the buffers; the files hold
every unit that is not cached (a cached dirty unit's file is stale until its write-back).

[Note: growing slots]
A swapper built with `grow=True` does not know its largest unit up front: whole-partition units
(offload_states.py, [Note: whole-partition units]) are as large as the partition they step, which
the ZeRO wrapper decides while registering. Every unit is created before any is swapped in, so
`create` resizes the (then all free) buffers to fit each new unit, and a buffer is allocated only
when first taken, an allocated free buffer always before a new one: a pool holding one unit
allocates one buffer, not `buffer_count`.

Files live in a private directory under `nvme_path`, removed by `close()`, when the swapper is
garbage collected, or at interpreter exit (`weakref.finalize`).
"""

from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine, Transfer, aligned_bytes, aligned_empty

__all__ = ["OptimizerSwapper", "StagingBuffers"]

_DTYPE = torch.float32
_ELEMENT_BYTES = 4


def aligned_numel(numel: int) -> int:
    return aligned_bytes(numel * _ELEMENT_BYTES) // _ELEMENT_BYTES


class StagingBuffers:
    """`count` flat fp32 buffers of `numel` elements (pinned when asked and CUDA is present), each
    starting at an `ALIGNMENT`-aligned address so unit transfers go through O_DIRECT. Only the
    swapper's (calling) thread takes and returns them: I/O threads never do, since a write-back
    and the read into the same buffer are one chained task. `lazy`: a buffer is allocated when it
    is first taken, so a pool with fewer units than buffers allocates one per unit only."""

    def __init__(self, count: int, numel: int, pin_memory: bool, lazy: bool = False) -> None:
        if count < 1:
            raise ValueError("offload_optimizer.buffer_count must be >= 1 for device 'nvme'")
        self.numel = numel
        self._pin = pin_memory and torch.cuda.is_available()
        self._buffers: list[torch.Tensor | None] = [None if lazy else self._allocate() for _ in range(count)]
        self._free = list(range(count))

    def _allocate(self) -> torch.Tensor:
        return aligned_empty(self.numel, _DTYPE, pin_memory=self._pin)

    @property
    def count(self) -> int:
        return len(self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far."""
        return [b for b in self._buffers if b is not None]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)

    def buffer(self, index: int) -> torch.Tensor:
        buffer = self._buffers[index]
        assert buffer is not None, "a staging buffer used before it was taken"
        return buffer

    def try_acquire(self) -> int | None:
        if not self._free:
            return None
        # an allocated buffer first: a lazy pool allocates another only when all of those are busy
        allocated = [i for i in self._free if self._buffers[i] is not None]
        index = allocated[0] if allocated else self._free[0]
        self._free.remove(index)
        if self._buffers[index] is None:
            self._buffers[index] = self._allocate()
        return index

    def release(self, index: int) -> None:
        self._free.append(index)

    def resize(self, numel: int) -> None:
        """Every buffer `numel` elements from now on; only while all are free (their bytes are dropped)."""
        if len(self._free) != self.count:
            raise RuntimeError("staging buffers resized while in use")
        self.numel = numel
        self._buffers = [None] * self.count


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class OptimizerSwapper:
    def __init__(self, swap_dir: str, num_tensors: int, max_unit_numel: int, buffer_count: int,
                 aio: AsyncIOEngine, pin_memory: bool, grow: bool = False) -> None:
        """`grow`: the slots fit the largest unit created so far ([Note: growing slots])."""
        os.makedirs(swap_dir, exist_ok=True)
        self.swap_dir = swap_dir
        self.num_tensors = num_tensors
        self.slot_numel = aligned_numel(max_unit_numel)
        self.grow = grow
        self.aio = aio
        self.pool = StagingBuffers(buffer_count, num_tensors * self.slot_numel, pin_memory, lazy=grow)
        self._numel: dict[int, int] = {}
        self._where: dict[int, int] = {}                 # uid -> buffer holding its bytes
        self._reads: dict[int, Future] = {}              # uid -> its read (in insertion order)
        self._held: set[int] = set()                     # swapped in (the caller's)
        self._cached: dict[int, None] = {}               # released, least recently first
        self._dirty: set[int] = set()                    # cached bytes newer than the file
        self._this_pass: set[int] = set()                # released since `begin_pass`
        self._writes: dict[int, Future] = {}             # uid -> write-back in flight
        self._finalizer = weakref.finalize(self, _remove_dir, swap_dir)

    # --- layout ---------------------------------------------------------------------------------
    def path(self, uid: int) -> str:
        return os.path.join(self.swap_dir, f"unit_{uid:06d}.swp")

    def _span(self, buffer: int, numel: int) -> torch.Tensor:
        """The bytes of a unit of `numel`: `num_tensors` aligned slots, end to end."""
        return self.pool.buffer(buffer).narrow(0, 0, self.num_tensors * aligned_numel(numel))

    def _views(self, buffer: int, numel: int) -> list[torch.Tensor]:
        stride = aligned_numel(numel)
        flat = self.pool.buffer(buffer)
        return [flat.narrow(0, t * stride, numel) for t in range(self.num_tensors)]

    # --- creating units --------------------------------------------------------------------------
    def create(self, uid: int, tensors: list[torch.Tensor]) -> None:
        """Write a new unit (synchronously): `tensors` are its master and states, same numel."""
        self._forget(uid)
        numel = tensors[0].numel()
        self._fit(numel)
        self._numel[uid] = numel
        buffer = self._claim_now()
        for view, tensor in zip(self._views(buffer, numel), tensors):
            view.copy_(tensor.reshape(-1))
        self.aio.write(self.path(uid), self._span(buffer, numel))
        self.pool.release(buffer)

    def create_fast(self, uid: int, master: torch.Tensor) -> None:
        """`offload_optimizer.fast_init`: a new unit whose states are zeros, without writing them.

        Only the master slot is written; the file is sized to the whole unit with `ftruncate`, and
        the filesystem reads the hole back as zeros."""
        self._forget(uid)
        numel = master.numel()
        self._fit(numel)
        self._numel[uid] = numel
        fd = os.open(self.path(uid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.num_tensors * aligned_bytes(numel * _ELEMENT_BYTES))
        finally:
            os.close(fd)
        buffer = self._claim_now()
        self._views(buffer, numel)[0].copy_(master.reshape(-1))
        self.aio.write(self.path(uid), self.pool.buffer(buffer).narrow(0, 0, aligned_numel(numel)))
        self.pool.release(buffer)

    def _fit(self, numel: int) -> None:
        """A new unit must fit a slot; a growing swapper's slots grow to it ([Note: growing slots])."""
        if aligned_numel(numel) <= self.slot_numel:
            return
        if not self.grow or self._where or self._held:
            raise RuntimeError(f"a swap unit of {numel} elements does not fit slots of {self.slot_numel}")
        self.slot_numel = aligned_numel(numel)
        self.pool.resize(self.num_tensors * self.slot_numel)

    def _forget(self, uid: int) -> None:
        """Drop any copy of `uid` (it is being re-created) once its I/O has finished."""
        if uid in self._held:
            raise RuntimeError(f"unit {uid} is swapped in; swap_out before re-creating it")
        for pending in (self._reads.pop(uid, None), self._writes.pop(uid, None)):
            if pending is not None:
                pending.result()
        if uid in self._where:
            self._cached.pop(uid, None)
            self._dirty.discard(uid)
            self.pool.release(self._where.pop(uid))

    # --- buffers ---------------------------------------------------------------------------------
    def _claim(self, this_pass_only: bool) -> tuple[int, int | None] | None:
        """A buffer and the dirty unit to write back before reusing it (or None): a free buffer,
        else the least recently released cached unit's ([Note: staging buffers as a write-back cache])."""
        buffer = self.pool.try_acquire()
        if buffer is not None:
            return buffer, None
        victim = next((u for u in self._cached if not this_pass_only or u in self._this_pass), None)
        if victim is None:
            return None
        del self._cached[victim]
        self._this_pass.discard(victim)
        buffer = self._where.pop(victim)
        if victim not in self._dirty:
            return buffer, None
        self._dirty.discard(victim)
        return buffer, victim

    def _claim_now(self) -> int:
        """A buffer for synchronous use: write-back done; a read-ahead is taken back if need be."""
        claimed = self._claim(this_pass_only=False)
        if claimed is None:
            if not self._reads:
                raise RuntimeError(f"all {self.pool.count} staging buffers are swapped in; swap_out first")
            uid = next(reversed(self._reads))            # the furthest read-ahead
            self._reads.pop(uid).result()
            return self._where.pop(uid)
        buffer, victim = claimed
        if victim is not None:
            self.aio.write(self.path(victim), self._span(buffer, self._numel[victim]))
        return buffer

    # --- the unit life cycle -----------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new sweep over the units starts: what was released so far may be needed again soon."""
        self._this_pass.clear()

    def prefetch(self, uid: int) -> bool:
        """Start reading `uid` if a buffer can be had without waiting; False when none can."""
        if uid in self._where:
            return True
        claimed = self._claim(this_pass_only=True)
        if claimed is None:
            return False
        self._start_read(uid, *claimed)
        return True

    def _start_read(self, uid: int, buffer: int, victim: int | None) -> None:
        """Read `uid` into `buffer`, after writing back `victim` from it (one chained task)."""
        pending = self._writes.pop(uid, None)
        if pending is not None:
            pending.result()
        transfers = [] if victim is None else [Transfer(self.path(victim), self._span(buffer, self._numel[victim]),
                                                        0, is_write=True)]
        transfers.append(Transfer(self.path(uid), self._span(buffer, self._numel[uid]), 0, is_write=False))
        future = self.aio.submit_chain(transfers)
        if victim is not None:
            self._writes[victim] = future
        self._reads[uid] = future
        self._where[uid] = buffer

    def swap_in(self, uid: int) -> list[torch.Tensor]:
        """The unit's tensors (views into a staging buffer), after its read completes."""
        if uid not in self._where:
            buffer = self._claim_now()
            self._start_read(uid, buffer, None)
        read = self._reads.pop(uid, None)
        if read is not None:
            read.result()
        self._cached.pop(uid, None)
        self._this_pass.discard(uid)
        self._held.add(uid)
        return self._views(self._where[uid], self._numel[uid])

    def swap_out(self, uid: int, dirty: bool = True) -> None:
        """Hand the unit back: it stays cached in its buffer, written back when the buffer is
        claimed ([Note: staging buffers as a write-back cache])."""
        self._held.remove(uid)
        if dirty:
            self._dirty.add(uid)
        self._cached[uid] = None
        self._this_pass.add(uid)

    def update(self, uid: int, fn: Callable[[list[torch.Tensor]], None]) -> None:
        """Read-modify-write of one unit (checkpoint load)."""
        fn(self.swap_in(uid))
        self.swap_out(uid)

    def flush(self) -> None:
        """Wait for every write-back in flight; re-raises an I/O error."""
        writes, self._writes = self._writes, {}
        for future in writes.values():
            future.result()

    # --- accounting / cleanup ---------------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        return self.pool.nbytes

    def resident_unit_bytes(self) -> int:
        """Bytes of unit tensors in the staging buffers right now (held, cached or being read)."""
        return sum(self.num_tensors * self._numel[uid] * _ELEMENT_BYTES for uid in self._where)

    def unit_numel(self, uid: int) -> int:
        return self._numel[uid]

    def in_buffer(self, uid: int) -> bool:
        """Whether the unit's bytes are in a staging buffer (held, cached or being read): if not,
        its file holds its current state."""
        return uid in self._where

    def file_bytes(self) -> int:
        return sum(os.path.getsize(self.path(uid)) for uid in self._numel if os.path.exists(self.path(uid)))

    def close(self) -> None:
        for future in self._reads.values():
            future.result()
        self._reads.clear()
        self.flush()
        self.aio.shutdown()
        self._finalizer()
