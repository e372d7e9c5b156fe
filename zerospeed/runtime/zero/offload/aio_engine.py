"""`AsyncIOEngine`: tensor <-> file transfers on a small thread pool (the `aio` block's role).

A transfer moves one contiguous CPU tensor to or from a byte offset in a file, in `block_size`
pieces with `os.pwrite` / `os.preadv` straight from and into the tensor's memory (no copy through
Python bytes). `submit_read` / `submit_write` return futures; up to `intra_op_parallelism`
transfers run at once, and at most `queue_depth` may be queued before a submit blocks
(back-pressure instead of unbounded memory).

[Note: O_DIRECT]
Like DeepSpeed's aio library, transfers bypass the page cache (`O_DIRECT`), so swapping to NVMe
does not fill host RAM with cached copies of the swap files. O_DIRECT needs the memory address,
the file offset and the length to be multiples of `ALIGNMENT`. A transfer whose address and
offset are aligned goes direct for its aligned prefix and buffered for the remaining tail; any
other transfer (an arbitrary tensor slice at an arbitrary byte offset) is buffered entirely. A
direct range covers whole pages only, so it never shares a page with a buffered range of another
transfer, and Linux keeps the two paths coherent on one file. Files are laid out in aligned
extents (`aligned_bytes`) and staging buffers come from `aligned_empty`, so the swappers' unit
transfers are direct. A directory whose filesystem refuses O_DIRECT (`EINVAL`) is switched to
buffered I/O with one warning. `direct_bytes` / `buffered_bytes` count the bytes each path moved.

[Note: why threads] `os.pread` / `os.pwrite` release the GIL, so Python threads overlap disk I/O
with the optimizer step, which also runs outside the GIL (the fused C++ kernel or torch ops).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerospeed.utils.logging import logger

__all__ = ["ALIGNMENT", "AsyncIOEngine", "Transfer", "aligned_bytes", "aligned_empty"]

ALIGNMENT = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)     # 0 where the platform has none (macOS): always buffered


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor <-> file transfer for `submit_chain`."""

    path: str
    tensor: torch.Tensor
    offset: int
    is_write: bool


def aligned_bytes(num_bytes: int, alignment: int = ALIGNMENT) -> int:
    """`num_bytes` rounded up to a multiple of `alignment` (pure)."""
    return -(-num_bytes // alignment) * alignment


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised flat tensor whose data pointer is `ALIGNMENT`-aligned (for O_DIRECT)."""
    num_bytes = numel * dtype.itemsize
    exact = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    if exact.data_ptr() % ALIGNMENT == 0:       # pinned memory is page aligned: no padding
        return exact.view(dtype)
    del exact
    raw = torch.empty(num_bytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    shift = -raw.data_ptr() % ALIGNMENT
    return raw.narrow(0, shift, num_bytes).view(dtype)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("aio transfers need a contiguous CPU tensor")
    return tensor.detach().view(-1).view(torch.uint8).numpy().data.cast("B")


class AsyncIOEngine:
    def __init__(self, block_size: int = 1_048_576, queue_depth: int = 8, intra_op_parallelism: int = 1,
                 use_direct_io: bool = True) -> None:
        self.block_size = int(block_size)
        self.use_direct_io = bool(use_direct_io) and _O_DIRECT != 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(intra_op_parallelism)),
                                        thread_name_prefix="zs-aio")
        self._slots = threading.BoundedSemaphore(max(1, int(queue_depth)))
        self._lock = threading.Lock()
        self._buffered_dirs: set[str] = set()       # filesystems that refused O_DIRECT
        self.bytes_read = 0
        self.bytes_written = 0
        self.direct_bytes = 0
        self.buffered_bytes = 0

    # --- synchronous primitives -----------------------------------------------------------------
    def write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> None:
        self._transfer(path, tensor, offset, is_write=True)

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> None:
        self._transfer(path, tensor, offset, is_write=False)

    def _transfer(self, path: str, tensor: torch.Tensor, offset: int, is_write: bool) -> None:
        """The direct prefix (see [Note: O_DIRECT]), then the buffered rest."""
        view = _byte_view(tensor)
        num_direct = self._direct_prefix_bytes(path, tensor.data_ptr(), len(view), offset)
        if num_direct and not self._try_direct(path, view[:num_direct], offset, is_write):
            num_direct = 0
        if num_direct < len(view):
            self._run(path, view[num_direct:], offset + num_direct, is_write, direct=False)
        with self._lock:
            if is_write:
                self.bytes_written += len(view)
            else:
                self.bytes_read += len(view)

    def _direct_prefix_bytes(self, path: str, address: int, num_bytes: int, offset: int) -> int:
        if not self.use_direct_io or os.path.dirname(os.path.abspath(path)) in self._buffered_dirs:
            return 0
        if address % ALIGNMENT or offset % ALIGNMENT:
            return 0
        return num_bytes // ALIGNMENT * ALIGNMENT

    def _try_direct(self, path: str, view: memoryview, offset: int, is_write: bool) -> bool:
        """False (and the directory switched to buffered I/O) when the filesystem refuses O_DIRECT."""
        try:
            self._run(path, view, offset, is_write, direct=True)
            return True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
        directory = os.path.dirname(os.path.abspath(path))
        with self._lock:
            first = directory not in self._buffered_dirs
            self._buffered_dirs.add(directory)
        if first:
            logger.warning(f"aio: the filesystem of {directory} refuses O_DIRECT; using buffered I/O there "
                           "(swap files will occupy the page cache)")
        return False

    def _run(self, path: str, view: memoryview, offset: int, is_write: bool, direct: bool) -> None:
        flags = (os.O_WRONLY | os.O_CREAT) if is_write else os.O_RDONLY
        fd = os.open(path, flags | (_O_DIRECT if direct else 0), 0o600)
        try:
            # a direct piece must stay aligned, so the block size is rounded down to ALIGNMENT
            block = max(ALIGNMENT, self.block_size // ALIGNMENT * ALIGNMENT) if direct else self.block_size
            for start in range(0, len(view), block):
                piece = view[start:start + block]
                if is_write:
                    _write_all(fd, piece, offset + start)
                else:
                    _read_all(fd, piece, offset + start, path, direct)
        finally:
            os.close(fd)
        with self._lock:
            if direct:
                self.direct_bytes += len(view)
            else:
                self.buffered_bytes += len(view)

    # --- asynchronous --------------------------------------------------------------------------
    def submit_write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self._submit(self.write, path, tensor, offset)

    def submit_read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self._submit(self.read, path, tensor, offset)

    def submit_chain(self, transfers: list[Transfer]) -> Future:
        """`transfers` one after another in one task (a write-back, then a read into the same
        buffer): the order holds whatever `intra_op_parallelism` is, and nothing blocks the caller."""
        return self._submit(self._run_chain, transfers)

    def _run_chain(self, transfers: list[Transfer]) -> None:
        for transfer in transfers:
            self._transfer(transfer.path, transfer.tensor, transfer.offset, transfer.is_write)

    def _submit(self, fn: Callable[..., None], *args: Any) -> Future:
        self._slots.acquire()
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _write_all(fd: int, piece: memoryview, position: int) -> None:
    done = 0
    while done < len(piece):
        done += os.pwrite(fd, piece[done:], position + done)


def _read_all(fd: int, piece: memoryview, position: int, path: str, direct: bool) -> None:
    done = 0
    while done < len(piece):
        got = os.preadv(fd, [piece[done:]], position + done)
        # a short direct read only happens at end of file (a retry would be unaligned: EINVAL)
        if got == 0 or (direct and got < len(piece) - done):
            raise OSError(f"{path}: unexpected end of file at byte {position + done + got}")
        done += got
