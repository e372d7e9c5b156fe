"""`AsyncIOEngine`: tensor <-> file transfers on a small thread pool (the `aio` block's role).

A transfer moves one contiguous CPU tensor to or from a byte offset in a file, in `block_size`
pieces with `os.pwrite` / `os.preadv` straight from and into the tensor's memory (no copy through
Python bytes). Files are laid out in `ALIGNMENT`-byte aligned extents (`aligned_bytes`), so the
same layout works if O_DIRECT is switched on later. `submit_read` / `submit_write` return
futures; up to `intra_op_parallelism` transfers run at once, and at most `queue_depth` may be
queued before a submit blocks (back-pressure instead of unbounded memory).

[Note: why threads] `os.pread` / `os.pwrite` release the GIL, so Python threads overlap disk I/O
with the optimizer step, which also runs outside the GIL (the fused C++ kernel or torch ops).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["ALIGNMENT", "AsyncIOEngine", "aligned_bytes"]

ALIGNMENT = 4096


def aligned_bytes(num_bytes: int, alignment: int = ALIGNMENT) -> int:
    """`num_bytes` rounded up to a multiple of `alignment` (pure)."""
    return -(-num_bytes // alignment) * alignment


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("aio transfers need a contiguous CPU tensor")
    return memoryview(tensor.detach().view(-1).view(torch.uint8).numpy()).cast("B")


class AsyncIOEngine:
    def __init__(self, block_size: int = 1_048_576, queue_depth: int = 8, intra_op_parallelism: int = 1) -> None:
        self.block_size = int(block_size)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(intra_op_parallelism)),
                                        thread_name_prefix="zs-aio")
        self._slots = threading.BoundedSemaphore(max(1, int(queue_depth)))
        self.bytes_read = 0
        self.bytes_written = 0

    # --- synchronous primitives -----------------------------------------------------------------
    def write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> None:
        view = _byte_view(tensor)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for start in range(0, len(view), self.block_size):
                piece = view[start:start + self.block_size]
                done = 0
                while done < len(piece):
                    done += os.pwrite(fd, piece[done:], offset + start + done)
        finally:
            os.close(fd)
        self.bytes_written += len(view)

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> None:
        view = _byte_view(tensor)
        fd = os.open(path, os.O_RDONLY)
        try:
            for start in range(0, len(view), self.block_size):
                piece = view[start:start + self.block_size]
                done = 0
                while done < len(piece):
                    got = os.preadv(fd, [piece[done:]], offset + start + done)
                    if got == 0:
                        raise OSError(f"{path}: unexpected end of file at byte {offset + start + done}")
                    done += got
        finally:
            os.close(fd)
        self.bytes_read += len(view)

    # --- asynchronous --------------------------------------------------------------------------
    def submit_write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self._submit(self.write, path, tensor, offset)

    def submit_read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self._submit(self.read, path, tensor, offset)

    def _submit(self, fn, path: str, tensor: torch.Tensor, offset: int) -> Future:  # type: ignore[no-untyped-def]
        self._slots.acquire()
        future = self._pool.submit(fn, path, tensor, offset)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
