"""Stage 0's gradient all-reduce, overlapped with backward (as DDP does).

[Note: overlapped all-reduce]
Parameters are cut once, at construction, into buckets of at most `bucket_numel` elements of one
dtype, in reverse registration order (roughly the order backward produces gradients). On the
micro-batch that ends an accumulation window, each parameter's gradient hook marks it ready;
buckets are launched — flattened and all-reduced asynchronously while backward goes on — strictly
in bucket order, each once all its members are ready. `finish()` (the backward epilogue) launches
the rest, with zeros for parameters that got no gradient on this rank, waits, and copies back.

At most `MAX_IN_FLIGHT_BUCKETS` launched buckets stay in flight: launching one more first waits
for the oldest and copies its result into the gradients ([Note: in-flight collectives] in
comm/in_flight.py). Holding every bucket until `finish()` kept a second copy of all gradients
alive at the end of backward, the step's peak (issue 21: a model's worth of RSS).

Reused buffers: with the bound, bucket `b` is flattened into buffer `b % MAX_IN_FLIGHT_BUCKETS` of a
`ReusedBuffers` ([Note: reused flat buffers] in reused_buffers.py): before bucket
`b + MAX_IN_FLIGHT_BUCKETS` is flattened, bucket `b` is waited for and copied back. On the wide4 GPT
(buckets of 4M elements then) fresh flat tensors took 28k of the 63k minor page faults of 11 steps.
On CPU, buckets are now at most 1M elements (4 MiB), so the two buffers hold 8 MiB where two 16 MiB
buckets were in flight before; measured on wide4, peak RSS 582 MiB (was 600; DDP 583) and ~0
faults per step. On wide10 the old buffers' frees had, as a side effect, raised glibc's mmap
threshold to 16 MiB, so activations were reused from the heap; without them its forward faults
again (10-40k a step, DDP 11k), as other systems': [Note: glibc mmap threshold] in
utils/host_allocator.py has the opt-in that settles it. Without the bound (several reduction
groups, below) every bucket gets a fresh buffer, as before.
With several reduction groups (expert parallelism) the buckets of different groups may launch in
a different order on different ranks, and an early wait on one group could then block a rank that
another rank waits for on the other: there every bucket waits for `finish()`, as before.

Because bucket membership and launch order are fixed, every rank issues the same collectives in
the same order even when ranks use different parameters (MoE experts, data-dependent branches):
a bucket waiting on a parameter this rank did not use simply launches at `finish()`. Only
`wait()` is called on a handle: gloo's async handles have no usable futures.

Over a group of one rank (the experts of an expert-data-parallel group of one, [Note: a group of
one] in runtime/zero/grad_buckets.py) a bucket is not flattened: each gradient is scaled in place,
in the communication dtype as the reduction would, and no copy of the bucket is held until `finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

from zerospeed import comm
from zerospeed.comm.in_flight import InFlightQueue
from zerospeed.runtime.reused_buffers import ReusedBuffers
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors

# Buckets are at most this many elements even when `reduce_bucket_size` is larger (DeepSpeed's
# default 5e8 would make one bucket, i.e. no overlap); DDP's buckets are 25 MiB. On CPU ranks the
# cap is smaller, so the reused buffers are ([Note: reused flat buffers]); an accelerator keeps
# fewer, larger collectives (each NCCL launch has a fixed cost).
MAX_OVERLAP_BUCKET_NUMEL = 1 << 22
MAX_OVERLAP_BUCKET_NUMEL_CPU = 1 << 20
# Launched buckets still in flight while backward goes on (as the stage-1/2 reducers keep).
MAX_IN_FLIGHT_BUCKETS = 2


def plan_buckets(numels: list[int], dtypes: list[torch.dtype], bucket_numel: int) -> list[list[int]]:
    """Parameter indices, last registered first, in runs of one dtype of at most `bucket_numel`
    elements (a larger parameter is a bucket of its own)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index in reversed(range(len(numels))):
        if current and (current_numel + numels[index] > bucket_numel or dtypes[current[0]] != dtypes[index]):
            buckets.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numels[index]
    if current:
        buckets.append(current)
    return buckets


def _buffer_numels(bucket_numels: list[int], num_buffers: int) -> list[int]:
    """Each reused buffer's size: the largest bucket that cycles through it (bucket b uses buffer b % n)."""
    sizes = [0] * min(num_buffers, len(bucket_numels))
    for bucket_index, numel in enumerate(bucket_numels):
        slot = bucket_index % num_buffers
        sizes[slot] = max(sizes[slot], numel)
    return sizes


class OverlappedAllReduce:
    def __init__(self, params: list[torch.Tensor], bucket_numel: int, group: Any, settings: PrecisionSettings,
                 average_world_size: int | None = None, bound_in_flight: bool = True) -> None:
        on_cpu = not params or params[0].device.type == "cpu"
        cap = MAX_OVERLAP_BUCKET_NUMEL_CPU if on_cpu else MAX_OVERLAP_BUCKET_NUMEL
        bucket_numel = max(1, min(int(bucket_numel), cap))
        dtypes = [settings.grad_accum_dtype] * len(params)
        self.buckets = plan_buckets([p.numel() for p in params], dtypes, bucket_numel)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.comm_dtype = settings.communication_dtype
        # Expert gradients are summed over a smaller group but averaged over the data-parallel world
        # ([Note: expert gradient reduction] in expert_gradients.py).
        self.before, self.after = averaging_factors(settings, average_world_size or comm.get_world_size(group))
        self._in_flight = InFlightQueue(MAX_IN_FLIGHT_BUCKETS if bound_in_flight else len(self.buckets))
        numels = [sum(params[index].numel() for index in bucket) for bucket in self.buckets]
        self._flat_buffers = ReusedBuffers(_buffer_numels(numels, MAX_IN_FLIGHT_BUCKETS) if bound_in_flight else [],
                                           self.comm_dtype)
        self._reset()

    def flat_buffers(self) -> list[torch.Tensor]:
        """The reused bucket buffers allocated so far (scratch between backwards: `offload_states`)."""
        return self._flat_buffers.allocated()

    def _reset(self) -> None:
        self._missing = [len(bucket) for bucket in self.buckets]
        self._ready = [False] * len(self.bucket_of)
        self._next_bucket = 0

    def mark_ready(self, index: int, grad_of: Callable[[int], torch.Tensor]) -> None:
        """A parameter's gradient is final for this window; launch every bucket now complete."""
        if self._ready[index]:
            return
        self._ready[index] = True
        self._missing[self.bucket_of[index]] -= 1
        while self._next_bucket < len(self.buckets) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket, grad_of)

    def _launch(self, bucket_index: int, grad_of: Callable[[int], torch.Tensor]) -> None:
        grads = [grad_of(index) for index in self.buckets[bucket_index]]
        self._next_bucket = bucket_index + 1
        if self.world_size == 1:
            for grad in grads:
                self._average_alone(grad)
            return
        flat = self._flatten(bucket_index, grads)
        if self.before != 1.0:
            flat.mul_(self.before)
        handle = comm.all_reduce(flat, group=self.group, async_op=True)
        self._in_flight.submit(handle, lambda: self._copy_back(flat, grads))

    def _flatten(self, bucket_index: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients in one flat tensor of the communication dtype (a reused buffer when
        in-flight buckets are bounded: [Note: reused flat buffers])."""
        if not len(self._flat_buffers):
            flat = _flatten_dense_tensors(grads)
            return flat.to(self.comm_dtype) if flat.dtype != self.comm_dtype else flat
        # The buffer's previous bucket must be copied back before it is overwritten.
        self._in_flight.reserve(1)
        buffer = self._flat_buffers.get(bucket_index % len(self._flat_buffers), grads[0].device)
        flat = buffer[:sum(grad.numel() for grad in grads)]
        offset = 0
        for grad in grads:
            flat[offset:offset + grad.numel()].copy_(grad.reshape(-1))
            offset += grad.numel()
        return flat

    def _average_alone(self, grad: torch.Tensor) -> None:
        """The averaging of a one-rank reduction, in place: the same roundings as flatten, scale, copy back."""
        if self.before == 1.0 and self.after == 1.0:
            return
        scaled = grad if grad.dtype == self.comm_dtype else grad.to(self.comm_dtype)
        for factor in (self.before, self.after):
            if factor != 1.0:
                scaled.mul_(factor)
        if scaled is not grad:
            grad.copy_(scaled)

    def _copy_back(self, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        if self.after != 1.0:
            flat.mul_(self.after)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def finish(self, grad_of: Callable[[int], torch.Tensor]) -> None:
        """Launch the buckets not yet launched (zeros where no gradient came), wait, copy back."""
        for bucket_index in range(self._next_bucket, len(self.buckets)):
            self._launch(bucket_index, grad_of)
        self._in_flight.drain()
        self._reset()
