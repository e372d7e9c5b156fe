"""Stage 0's gradient all-reduce, overlapped with backward (as DDP does).

[Note: overlapped all-reduce]
On the micro-batch that ends an accumulation window, each parameter's gradient hook hands the
finished gradient to `OverlappedAllReduce.add`. Gradients are packed, in the order backward
produces them, into buckets of at most `bucket_numel` elements of one dtype; a full bucket is
flattened and all-reduced asynchronously while backward goes on. `finish()` (the backward
epilogue) reduces whatever the hooks did not see — gradients still to come from a later hook
never exist, so those are parameters with no gradient this window, reduced as zeros so every rank
issues the same collectives — then waits for every bucket and copies the averages back.
Every rank must produce gradients in the same order (the same graph), as with DDP. Only `wait()`
is called on a handle: gloo's async handles have no usable futures (peer-figures.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zerospeed import comm
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors

# Buckets are at most this many elements even when `reduce_bucket_size` is larger (DeepSpeed's
# default 5e8 would make one bucket, i.e. no overlap); DDP's buckets are 25 MiB.
MAX_OVERLAP_BUCKET_NUMEL = 1 << 22


@dataclasses.dataclass
class _Bucket:
    indices: list[int]
    grads: list[torch.Tensor]
    flat: torch.Tensor | None = None
    handle: Any = None


class OverlappedAllReduce:
    def __init__(self, num_params: int, bucket_numel: int, group: Any, settings: PrecisionSettings) -> None:
        self.num_params = num_params
        self.bucket_numel = max(1, min(int(bucket_numel), MAX_OVERLAP_BUCKET_NUMEL))
        self.group = group
        self.settings = settings
        self.world_size = comm.get_world_size(group)
        self.before, self.after = averaging_factors(settings, self.world_size)
        self._reset()

    def _reset(self) -> None:
        self._open = _Bucket([], [])
        self._open_numel = 0
        self._launched: list[_Bucket] = []
        self._seen = [False] * self.num_params

    def add(self, index: int, grad: torch.Tensor) -> None:
        """A finished gradient: pack it, launching the open bucket when full or of another dtype."""
        if self._seen[index]:
            return
        self._seen[index] = True
        if self._open.grads and (self._open_numel + grad.numel() > self.bucket_numel
                                 or self._open.grads[0].dtype != grad.dtype):
            self._launch()
        self._open.indices.append(index)
        self._open.grads.append(grad)
        self._open_numel += grad.numel()

    def _launch(self) -> None:
        bucket = self._open
        flat = _flatten_dense_tensors(bucket.grads)
        comm_dtype = self.settings.communication_dtype
        flat = flat.to(comm_dtype) if flat.dtype != comm_dtype else flat
        if self.before != 1.0:
            flat.mul_(self.before)
        bucket.flat = flat
        bucket.handle = comm.all_reduce(flat, group=self.group, async_op=True)
        self._launched.append(bucket)
        self._open = _Bucket([], [])
        self._open_numel = 0

    def finish(self, grad_of: Callable[[int], torch.Tensor]) -> None:
        """Reduce what the hooks did not see (in index order), wait for all, copy back."""
        for index in range(self.num_params):
            if not self._seen[index]:
                self.add(index, grad_of(index))
        if self._open.grads:
            self._launch()
        for bucket in self._launched:
            bucket.handle.wait()
            assert bucket.flat is not None
            if self.after != 1.0:
                bucket.flat.mul_(self.after)
            for grad, reduced in zip(bucket.grads, _unflatten_dense_tensors(bucket.flat, bucket.grads)):
                grad.copy_(reduced)
        self._reset()

