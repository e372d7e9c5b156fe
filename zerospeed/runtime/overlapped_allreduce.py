"""Stage 0's gradient all-reduce, overlapped with backward (as DDP does), in place in the gradients.

[Note: overlapped all-reduce]
Parameters are cut once, at construction, into buckets of at most `bucket_numel` elements of one
dtype, in reverse registration order (roughly the order backward produces gradients). On the
micro-batch that ends an accumulation window, each parameter's gradient hook marks it ready;
buckets are launched — all-reduced asynchronously while backward goes on — strictly in bucket
order, each once all its members are ready. `finish()` (the backward epilogue) launches the rest
(zeros for parameters that got no gradient on this rank) and waits for all of them.

[Note: gradients as bucket views]
Every bucket is a slice of one flat tensor per reducer, allocated on first use and kept for the
run, and each parameter's gradient is a view of its slot in it (DDP's `gradient_as_bucket_view`).
At the start of an accumulation window (`start_window`, from the first micro-batch's
`prepare_backward`) the flat tensor is zeroed and, where gradients live in the parameters, each
`param.grad` is pointed at its view: autograd's gradient accumulation then adds every micro-batch's
gradient straight into the bucket (in place, as it adds into any existing `.grad`), a gradient
hook only counts readiness, and a bucket is all-reduced where it lies, with no flatten and no copy
back. Issue 33 measured those two copies per gradient (plus a fresh gradient per parameter and
step, first-touched anew) as most of stage 0's CPU above DDP's on a small model. The bits are the
old ones: each bucket holds the same elements at the same offsets as the flattened copy did, zero
plus the first gradient is that gradient, and the averaging factors are applied in the same order
and dtype. Only a zero's sign can differ (0 + -0 is +0).
A gradient that is not its view at launch (set to None or replaced by the user, `module.zero_grad`
mid-window, a backward outside `engine.backward`) is copied into the view, or zeroed if None, and
`param.grad` is pointed at the view again, as DDP does. With a separate accumulation dtype
(`grad_accum_dtype` other than the parameters') the owner adds each gradient into its view and
`param.grad` stays None. When the communication dtype differs from the gradients', a bucket is
converted into a flat buffer of that dtype, reduced there and converted back.

In flight: with views nothing is reused while a bucket is reduced, so buckets stay in flight until
`finish()`, as in DDP. Conversion buffers are reused ([Note: reused flat buffers] in
reused_buffers.py): bucket `b` is converted into buffer `b % MAX_IN_FLIGHT_BUCKETS`, and at most
that many buckets stay in flight, launching one more first waiting for the oldest ([Note:
in-flight collectives] in comm/in_flight.py). With several reduction groups (expert parallelism)
the buckets of different groups may launch in a different order on different ranks, and an early
wait on one group could then block a rank that another rank waits for on the other: there every
bucket waits for `finish()`, and conversion buffers are fresh per bucket.

Because bucket membership and launch order are fixed, every rank issues the same collectives in
the same order even when ranks use different parameters (MoE experts, data-dependent branches):
a bucket waiting on a parameter this rank did not use simply launches at `finish()`. Only
`wait()` is called on a handle: gloo's async handles have no usable futures.

Over a group of one rank (the experts of an expert-data-parallel group of one, [Note: a group of
one] in runtime/zero/grad_buckets.py) nothing is exchanged: the bucket is scaled in place, in the
communication dtype as the reduction would.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.in_flight import InFlightQueue
from zerospeed.runtime.reused_buffers import ReusedBuffers
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors

__all__ = ["MAX_IN_FLIGHT_BUCKETS", "MAX_OVERLAP_BUCKET_NUMEL", "MAX_OVERLAP_BUCKET_NUMEL_CPU",
           "OverlappedAllReduce", "plan_buckets"]

# Buckets are at most this many elements even when `reduce_bucket_size` is larger (DeepSpeed's
# default 5e8 would make one bucket, i.e. no overlap); DDP's buckets are 25 MiB. On CPU ranks the
# cap is smaller (more, earlier launches); an accelerator keeps fewer, larger collectives (each
# NCCL launch has a fixed cost). The caps also fix each element's place in its collective, which
# the bits of a ring all-reduce over more than two ranks depend on.
MAX_OVERLAP_BUCKET_NUMEL = 1 << 22
MAX_OVERLAP_BUCKET_NUMEL_CPU = 1 << 20
# Launched buckets still in flight while conversion buffers are reused ([Note: gradients as bucket views]).
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
    """The buckets of `params`, their gradients as views of them, and their overlapped all-reduce.

    `grads_in_params`: gradients accumulate in `param.grad` (pointed at its view at each window's
    start); else the owner adds them into `views()` itself and `param.grad` is left alone."""

    def __init__(self, params: list[torch.Tensor], bucket_numel: int, group: Any, settings: PrecisionSettings,
                 average_world_size: int | None = None, bound_in_flight: bool = True,
                 grads_in_params: bool = True) -> None:
        on_cpu = not params or params[0].device.type == "cpu"
        cap = MAX_OVERLAP_BUCKET_NUMEL_CPU if on_cpu else MAX_OVERLAP_BUCKET_NUMEL
        bucket_numel = max(1, min(int(bucket_numel), cap))
        self.params = list(params)
        self.grads_in_params = grads_in_params
        self.grad_dtype = settings.grad_accum_dtype
        self.buckets = plan_buckets([p.numel() for p in params], [self.grad_dtype] * len(params), bucket_numel)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self._init_layout()
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.comm_dtype = settings.communication_dtype
        # Expert gradients are summed over a smaller group but averaged over the data-parallel world
        # ([Note: expert gradient reduction] in expert_gradients.py).
        self.before, self.after = averaging_factors(settings, average_world_size or comm.get_world_size(group))
        converts = self.comm_dtype != self.grad_dtype
        bounded = converts and bound_in_flight
        self._in_flight = InFlightQueue(MAX_IN_FLIGHT_BUCKETS if bounded else len(self.buckets))
        numels = [end - start for start, end in self._bucket_ranges]
        self._comm_buffers = ReusedBuffers(_buffer_numels(numels, MAX_IN_FLIGHT_BUCKETS) if bounded else [],
                                           self.comm_dtype)
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._reset()

    def _init_layout(self) -> None:
        """Bucket b is `flat[start:end]`, its members one after another in bucket order (the order
        the flattened copy had: [Note: gradients as bucket views])."""
        self._bucket_ranges: list[tuple[int, int]] = []
        self._slots: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        offset = 0
        for bucket in self.buckets:
            start = offset
            for index in bucket:
                numel = self.params[index].numel()
                self._slots[index] = (offset, numel)
                offset += numel
            self._bucket_ranges.append((start, offset))
        self.total_numel = offset

    # --- the bucket storage and the gradients' views ----------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """Each parameter's gradient slot in its bucket (the flat tensor allocated on first use)."""
        if self._flat is None:
            device = self.params[0].device if self.params else torch.device("cpu")
            self._flat = torch.zeros(self.total_numel, dtype=self.grad_dtype, device=device)
            self._views = [self._flat[offset:offset + numel].view(param.shape)
                           for param, (offset, numel) in zip(self.params, self._slots)]
        return self._views

    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat bucket tensor and every view of it (none before the first window)."""
        return [] if self._flat is None else [self._flat, *self._views]

    def flat_buffers(self) -> list[torch.Tensor]:
        """The reused conversion buffers allocated so far (scratch between backwards: `offload_states`)."""
        return self._comm_buffers.allocated()

    @torch.no_grad()
    def start_window(self) -> None:
        """Zero the buckets for a new accumulation window; point each `param.grad` at its view,
        keeping a gradient already there (produced since the last zero_grad) by copying it in."""
        views = self.views()
        assert self._flat is not None
        self._flat.zero_()
        if not self.grads_in_params:
            return
        for param, view in zip(self.params, views):
            grad = param.grad
            if grad is not view:
                if grad is not None:
                    view.copy_(grad)
                param.grad = view

    @torch.no_grad()
    def _adopt(self, bucket_index: int) -> None:
        """Make each member's view hold its gradient (the fallback of [Note: gradients as bucket views])."""
        views = self._views
        for index in self.buckets[bucket_index]:
            param, view = self.params[index], views[index]
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            param.grad = view

    # --- readiness and the reductions -----------------------------------------------------------------
    def _reset(self) -> None:
        self._missing = [len(bucket) for bucket in self.buckets]
        self._ready = [False] * len(self.bucket_of)
        self._next_bucket = 0

    def mark_ready(self, index: int) -> None:
        """A parameter's gradient is final for this window; launch every bucket now complete."""
        if self._ready[index]:
            return
        self._ready[index] = True
        self._missing[self.bucket_of[index]] -= 1
        while self._next_bucket < len(self.buckets) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, bucket_index: int) -> None:
        self._next_bucket = bucket_index + 1
        if self._flat is None:   # no window was started: nothing accumulated, the gradients are zeros
            self.start_window()
        assert self._flat is not None
        if self.grads_in_params:
            self._adopt(bucket_index)
        start, end = self._bucket_ranges[bucket_index]
        bucket = self._flat[start:end]
        if self.world_size == 1:
            self._average_alone(bucket_index, bucket)
            return
        flat = self._comm_input(bucket_index, bucket)
        if self.before != 1.0:
            flat.mul_(self.before)
        handle = comm.all_reduce(flat, group=self.group, async_op=True)
        self._in_flight.submit(handle, lambda: self._complete(flat, bucket))

    def _comm_input(self, bucket_index: int, bucket: torch.Tensor) -> torch.Tensor:
        """The bucket itself, or its copy in the communication dtype (a reused buffer when in-flight
        buckets are bounded)."""
        if self.comm_dtype == self.grad_dtype:
            return bucket
        if not len(self._comm_buffers):
            return bucket.to(self.comm_dtype)
        # The buffer's previous bucket must be converted back before it is overwritten.
        self._in_flight.reserve(1)
        buffer = self._comm_buffers.get(bucket_index % len(self._comm_buffers), bucket.device)
        flat = buffer[:bucket.numel()]
        flat.copy_(bucket)
        return flat

    def _average_alone(self, bucket_index: int, bucket: torch.Tensor) -> None:
        """The averaging of a one-rank reduction: the same roundings as scale, reduce, scale (none
        at all, not even the dtype's, when there is nothing to scale)."""
        if self.before == 1.0 and self.after == 1.0:
            return
        flat = self._comm_input(bucket_index, bucket)
        for factor in (self.before, self.after):
            if factor != 1.0:
                flat.mul_(factor)
        if flat is not bucket:
            bucket.copy_(flat)

    def _complete(self, flat: torch.Tensor, bucket: torch.Tensor) -> None:
        if self.after != 1.0:
            flat.mul_(self.after)
        if flat is not bucket:
            bucket.copy_(flat)

    def finish(self) -> None:
        """Launch the buckets not yet launched (zeros where no gradient came), wait for all."""
        for bucket_index in range(self._next_bucket, len(self.buckets)):
            self._launch(bucket_index)
        self._in_flight.drain()
        self._reset()
