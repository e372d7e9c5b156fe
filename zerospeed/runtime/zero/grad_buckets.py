"""Bucketed, optionally overlapped reduction of gradients into their owners' partitions (ZeRO 1/2).

Two shapes of bucket, one reducer:

- Stage 1 reduces a full flat gradient buffer at the boundary in `Slab`s (partition.py, [Note:
  slab buckets]): `world_size` equal rows, row r the slice of rank r's partition, so each slab is
  one equal-split `reduce_scatter_tensor` (`reduce_scatter: true`) or one `all_reduce` after
  which each rank keeps its own row (`reduce_scatter: false`; on gloo often the faster).
- Stage 2 (`GradientBuckets`) takes gradients in the order backward produces them: each is
  copied into the open bucket (`contiguous_gradients`; without it the gradient is held and
  concatenated when the bucket is reduced) and freed; a bucket of `reduce_bucket_size` elements
  is reduced as soon as it is full, each slice going to the rank that owns it. With
  `reduce_scatter: true` that is a reduce-scatter with uneven splits, which no
  `reduce_scatter_tensor` can express: one `all_to_all_single` sends every slice to its owner,
  which sums the W copies it receives. With `reduce_scatter: false` the bucket is all-reduced
  and each rank keeps the slices it owns (DeepSpeed's `use_multi_rank_bucket_allreduce`).

[Note: buckets fill from the end] A stage-2 bucket is laid out in the reverse of the order its
gradients arrived: the first one at the end of the buffer, each next one before it. Backward
produces gradients roughly in the reverse of the parameters' order, so the bucket comes out in
flat order, where every owner's slices are one run and the owners follow in rank order: the
bucket is already the `all_to_all_single` input, with no owner-ordered copy (one bucket less at
the peak, one memcpy less per bucket). Any other order (several param groups, a graph that
produces gradients out of order) falls back to that copy.

[Note: stage-2 scratch reuse] A bucket, the buffer its owner-ordered slices are received in and
their sum over ranks are scratch of up to `MAX_BUCKET_NUMEL` elements each, needed from one
bucket to the next every backward. Allocated fresh per bucket they were mapped and first-touched
anew whenever glibc had returned the previous ones (a block above its mmap threshold): on the
49.6M GPT ~13 buckets a step of 16 + 16 + 8 MiB, 8-45k minor faults a step where DDP, whose
buckets live for the run, faulted ~0-8k (issue 33). So each of the three comes from a
`ScratchSlots` of `MAX_OUTSTANDING + 1` buffers (one with `overlap_comm` off), taken in turn from
slot 0 each backward: the reduction that last used a slot is at least `MAX_OUTSTANDING + 1`
submissions old, so the in-flight bound has already finished it. A slot grows to the largest use it has seen and then
stays: one bucket's worth of each scratch lives for the run (three with `overlap_comm`), what
was transiently resident at every bucket before. No use exceeds a bucket ([Note: oversized
gradients]): the bucket slot holds at most `bucket_numel` elements, the sum as many, the
receive buffer W times as many (a bucket that one rank owns whole).

[Note: oversized gradients] A parameter larger than a bucket (a 50k-vocabulary embedding: 19.3M
elements against the 4M cap) was a bucket of its own, and every scratch slot it used grew to its
size for the rest of the run: on the vocab50k GPT (issue 33) a 77 MiB bucket slot, a receive
buffer of 2 x 50 MiB and a 50 MiB sum, resident from the first backward on (run.py's model
state 478 MiB; 316 now, DeepSpeed's 326). Its gradient is reduced instead in near-equal pieces
of at most `bucket_numel` elements, one reduction each, and a piece already in the
communication dtype is sent from the gradient itself: no bucket copy at all.
The reduction may scale or overwrite the gradient in place: at stage 2 it is the hook's to
consume (freed right after), at stage 1 with `overlap_comm` it is the accumulation buffer, whose
slices of other ranks the step never reads (as in [Note: slabs in place]). A piece that must
change dtype is copied into a bucket slot as a bucket is. The pieces sum the same elements in the same order: the result is bitwise the same.

Either way a step sends the trainable gradient volume once per reduction (the comms logger counts
each bucket's input) and, with `overlap_comm`, runs asynchronously while backward continues: two
reductions stay in flight while the next bucket fills (`MAX_OUTSTANDING`, [Note: in-flight
collectives] in comm/in_flight.py), three buckets of communication memory at the peak.
Every rank must produce gradients in the same order (the same graph), as in DeepSpeed, so that
all ranks issue the same collectives.

[Note: a group of one] A param group partitioned over one rank (an expert group whose
expert-data-parallel group is one rank: ep_size = world size, every rank holds experts no other
rank holds; or any group of a one-rank run) has nothing to exchange. Its
gradients skip the bucket: each is scaled by the averaging factors, in the order and dtype a
reduction would apply them (so the bits equal the bucketed path's), and added straight into the
partition. A bucket of such a group would otherwise hold the whole group's gradients, and the
exchange over one rank a second copy and its sum a third: 3x the group's gradient bytes at the
peak (bench_moe.py, 2 ranks at ep 2: the largest part of the peak RSS above DeepSpeed's).

With optimizer offload the destinations are host buffers and the reducer hands each reduced
slice to a `HostGradientSink` (host_grads.py) instead of writing it in place: the copy to host
memory then overlaps the rest of backward; the wrapper synchronizes the sink at its end.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.in_flight import InFlightQueue
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.partition import GroupLayout, Slab, owner_fragments, slab_real_numel

__all__ = ["GradReducer", "GradientBuckets", "MAX_BUCKET_NUMEL", "MAX_OUTSTANDING", "OwnedSlice",
           "ScratchSlots", "reduce_flat_gradients"]

# Reductions still in flight while the next bucket fills (stages 1/2; stage 3 keeps one).
MAX_OUTSTANDING = 2
# [Note: bucket cap] A stage-2 bucket holds at most this many elements whatever
# `reduce_bucket_size` says (stage 0 caps its buckets alike, overlapped_allreduce.py). A bucket
# and its receive buffer live together, and with DeepSpeed's default of 5e8 one bucket would be
# the whole model: two extra copies of every gradient at the end of backward (issue 21).
MAX_BUCKET_NUMEL = 1 << 22


@dataclasses.dataclass(frozen=True)
class OwnedSlice:
    """`numel` elements at `bucket_offset` of a stage-2 bucket, owned by `dp_rank`."""

    dp_rank: int
    bucket_offset: int
    numel: int
    dest: torch.Tensor | None             # this rank's gradient partition slice, if it owns it


class ScratchSlots:
    """`num_slots` flat buffers of one dtype taken in turn ([Note: stage-2 scratch reuse]); each
    grows to the largest request it has served and is kept."""

    def __init__(self, num_slots: int) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * num_slots
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The next slot's first `numel` elements (its earlier contents are stale)."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[slot] = torch.empty(numel, dtype=dtype, device=device)
        return buffer.narrow(0, 0, numel)

    def restart(self) -> None:
        """Nothing is in flight: the next take is slot 0's, so every backward maps its buckets to
        the same slots and each slot reaches its size in the first one."""
        self._next = 0

    def allocated(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]


class GradReducer:
    def __init__(self, group: Any, settings: PrecisionSettings, use_reduce_scatter: bool,
                 overlap_comm: bool, sink: HostGradientSink | None = None,
                 average_world_size: int | None = None) -> None:
        self.group = group
        self.sink = sink                  # offload: destinations are host buffers, written through it
        self.dp_rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.use_reduce_scatter = use_reduce_scatter
        self.overlap_comm = overlap_comm
        # Expert gradients: summed over the expert-data-parallel group, averaged over the data-parallel
        # world ([Note: expert gradient reduction] in runtime/expert_gradients.py).
        self.before, self.after = averaging_factors(settings, average_world_size or self.world_size)
        self._in_flight = InFlightQueue(MAX_OUTSTANDING if overlap_comm else 0)
        # [Note: stage-2 scratch reuse]: one slot per reduction that may be alive at once.
        self.num_scratch_slots = self._in_flight.max_outstanding + 1
        self._received = ScratchSlots(self.num_scratch_slots)
        self._summed = ScratchSlots(self.num_scratch_slots)

    def scratch_buffers(self) -> list[torch.Tensor]:
        """The receive and sum buffers kept between backwards (`offload_states`' scratch)."""
        return self._received.allocated() + self._summed.allocated()

    def reduce(self, rows: torch.Tensor, dest: torch.Tensor) -> None:
        """Sum `rows` ([W * n], one row per rank) over ranks; this rank's row into `dest` ([n]).
        `dest` may be this rank's row of `rows` ([Note: slabs in place])."""
        self._scale(rows, self.before)
        row_numel = rows.numel() // self.world_size
        if self.world_size == 1:   # [Note: a group of one]
            self._store(dest, self._scale(rows, self.after), accumulate=False)
            return
        own_row = rows.narrow(0, self.dp_rank * row_numel, row_numel)
        if self.use_reduce_scatter:
            output = dest if self._receives_in_place(dest, rows, own_row) else \
                torch.empty(row_numel, dtype=rows.dtype, device=rows.device)
            handle = comm.reduce_scatter_tensor(output, rows, group=self.group, async_op=self.overlap_comm)
        else:
            handle = comm.all_reduce(rows, group=self.group, async_op=self.overlap_comm)
            output = own_row

        def finish() -> None:
            reduced = self._scale(output, self.after)
            if reduced.data_ptr() != dest.data_ptr():
                self._store(dest, reduced, accumulate=False)
        self._in_flight.submit(handle, finish, keepalive=(rows, output))

    def _receives_in_place(self, dest: torch.Tensor, rows: torch.Tensor, own_row: torch.Tensor) -> bool:
        """Whether the reduce-scatter may write straight into `dest`: a plain tensor of the rows' dtype,
        either apart from them or exactly this rank's row (the in-place form NCCL documents)."""
        if self.sink is not None or dest.dtype != rows.dtype or not dest.is_contiguous():
            return False
        apart = dest.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
        return apart or dest.data_ptr() == own_row.data_ptr()

    def reduce_to_owners(self, flat: torch.Tensor, slices: list[OwnedSlice], accumulate: bool = True) -> None:
        """Sum `flat` over ranks; add (or copy) each slice this rank owns into its `dest`. With
        reduce-scatter, `flat` is released once its owner-ordered copy is made."""
        self._scale(flat, self.before)
        mine = [s for s in slices if s.dp_rank == self.dp_rank]
        keepalive: tuple[torch.Tensor, ...]   # what the collective reads or writes, until it is done
        if not self.use_reduce_scatter:
            handle = comm.all_reduce(flat, group=self.group, async_op=self.overlap_comm)
            summed, starts, keepalive = (lambda: flat), [s.bucket_offset for s in mine], (flat,)
        else:
            by_owner = sorted(slices, key=lambda s: s.dp_rank)          # stable: bucket order per owner
            send = flat if _is_laid_out(by_owner, flat.numel()) else \
                torch.cat([flat.narrow(0, s.bucket_offset, s.numel) for s in by_owner])
            del flat
            send_splits = [0] * self.world_size
            for owned in slices:
                send_splits[owned.dp_rank] += owned.numel
            mine_numel = send_splits[self.dp_rank]
            received = self._received.take(self.world_size * mine_numel, send.dtype, send.device)
            total = self._summed.take(mine_numel, send.dtype, send.device)
            handle = comm.all_to_all_single(received, send, [mine_numel] * self.world_size, send_splits,
                                            group=self.group, async_op=self.overlap_comm)
            summed = lambda: torch.sum(received.view(self.world_size, mine_numel), dim=0, out=total)  # noqa: E731
            starts, keepalive = list(itertools.accumulate((s.numel for s in mine), initial=0))[:-1], (send, received)

        def finish() -> None:
            total = summed()
            for owned, start in zip(mine, starts):
                assert owned.dest is not None
                reduced = self._scale(total.narrow(0, start, owned.numel), self.after)
                self._store(owned.dest, reduced, accumulate)
        self._in_flight.submit(handle, finish, keepalive)

    def store_local(self, grad: torch.Tensor, dest: torch.Tensor, comm_dtype: torch.dtype, accumulate: bool) -> None:
        """A group of one rank ([Note: a group of one]): `grad` ([n]) averaged as `reduce_to_owners`
        would (in `comm_dtype`, `before` then `after`), added (or copied) into `dest` ([n]).
        `grad` itself is never modified."""
        scaled = self.before != 1.0 or self.after != 1.0
        if grad.dtype != comm_dtype or scaled:
            grad = grad.to(comm_dtype, copy=True)
        self._store(dest, self._scale(self._scale(grad, self.before), self.after), accumulate)

    def wait_all(self) -> None:
        self._in_flight.drain()
        self._received.restart()
        self._summed.restart()

    def _store(self, dest: torch.Tensor, reduced: torch.Tensor, accumulate: bool) -> None:
        if self.sink is not None:
            (self.sink.add if accumulate else self.sink.copy)(dest, reduced)
        elif accumulate:
            dest.add_(reduced)
        else:
            dest.copy_(reduced)

    @staticmethod
    def _scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
        return tensor.mul_(factor) if factor != 1.0 else tensor


def _is_laid_out(slices: list[OwnedSlice], numel: int) -> bool:
    """Whether `slices`, in this order, tile a buffer of `numel` elements from its start."""
    position = 0
    for owned in slices:
        if owned.bucket_offset != position:
            return False
        position += owned.numel
    return position == numel


def reduce_flat_gradients(flat_grad: torch.Tensor, layout: GroupLayout, slabs: list[Slab],
                          reducer: GradReducer, comm_dtype: torch.dtype,
                          partition: torch.Tensor | None = None) -> None:
    """Stage 1 at the boundary: reduce a full flat gradient buffer; this rank's partition of it
    (or `partition`, a separate buffer of partition size) then holds the reduced (averaged)
    gradients. Other partitions are left scaled or stale: the step reads only this rank's.

    [Note: slabs in place] A slab as wide as the partitions (the default `reduce_bucket_size`
    makes one) is a contiguous run of the buffer already laid out as the reduce-scatter's input,
    and this rank's partition is that input's own row: reduced where it lies, it needs neither a
    copy of the rows nor a receive buffer, up to 1.5x the model's gradients at the peak. Narrower
    slabs, or a communication dtype other than the buffer's, reduce a copy of the rows."""
    rows_view = flat_grad.view(layout.world_size, layout.partition_numel)
    if partition is None:
        partition = rows_view[reducer.dp_rank]
    for slab in slabs:
        if slab_real_numel(layout, slab) == 0:
            continue  # pure padding: zeros on every rank
        window = rows_view.narrow(1, slab.offset, slab.numel)
        rows = window
        if not window.is_contiguous() or window.dtype != comm_dtype:
            rows = torch.empty(window.shape, dtype=comm_dtype, device=flat_grad.device)
            rows.copy_(window)
        reducer.reduce(rows.view(-1), partition.narrow(0, slab.offset, slab.numel))
    reducer.wait_all()


class GradientBuckets:
    """Stage 2: gradients bucketed in production order, each full bucket reduced to the owners."""

    def __init__(self, layouts: list[GroupLayout], partitions: list[torch.Tensor], reducer: GradReducer,
                 comm_dtype: torch.dtype, bucket_numel: int, contiguous_gradients: bool,
                 accumulate: bool = True) -> None:
        if bucket_numel < 1:
            raise ValueError(f"reduce_bucket_size must be positive, got {bucket_numel}")
        self.owners = [owner_fragments(layout) for layout in layouts]
        self.partitions = partitions      # this rank's gradient partition per group (accumulated)
        self.reducer = reducer
        self.comm_dtype = comm_dtype
        self.bucket_numel = min(bucket_numel, MAX_BUCKET_NUMEL, max(1, sum(layout.numel for layout in layouts)))
        self.contiguous_gradients = contiguous_gradients
        self.accumulate = accumulate      # False: the reduced slices replace the partition (stage 1)
        self._arrived: set[tuple[int, int]] = set()
        self._bucket_slots = ScratchSlots(reducer.num_scratch_slots)   # [Note: stage-2 scratch reuse]
        self._open_bucket()

    def scratch_buffers(self) -> list[torch.Tensor]:
        """Bucket, receive and sum buffers kept between backwards (`offload_states`' scratch)."""
        return self._bucket_slots.allocated() + self.reducer.scratch_buffers()

    def _open_bucket(self) -> None:
        self._entries: list[tuple[int, int, int, int]] = []  # (group, param, elements before it, numel)
        self._filled = 0
        self._buffer: torch.Tensor | None = None
        self._held: list[torch.Tensor] = []

    def add_grad(self, group_index: int, param_index: int, grad: torch.Tensor) -> None:
        key = (group_index, param_index)
        if key in self._arrived:
            raise RuntimeError("Gradient computed twice for this partition: a parameter's gradient was "
                               "produced twice before the backward epilogue (ZeRO stage 2 reduces each "
                               "gradient once per backward; no_sync is not supported at stage 2).")
        self._arrived.add(key)
        if self.reducer.world_size == 1:   # [Note: a group of one]: no bucket, no exchange
            flat = grad.detach().reshape(-1)
            for _, frag in self.owners[group_index][param_index]:
                dest = self.partitions[group_index].narrow(0, frag.partition_start, frag.numel)
                self.reducer.store_local(flat.narrow(0, frag.param_start, frag.numel), dest, self.comm_dtype,
                                         self.accumulate)
            return
        numel = grad.numel()
        if self._entries and self._filled + numel > self.bucket_numel:
            self._reduce_bucket()
        flat = grad.detach().reshape(-1)
        if numel > self.bucket_numel:
            self._reduce_oversized(group_index, param_index, flat)
            return
        if self.contiguous_gradients:
            if self._buffer is None:
                self._buffer = self._bucket_slots.take(self.bucket_numel, self.comm_dtype, grad.device)
            end = self._buffer.numel() - self._filled       # [Note: buckets fill from the end]
            self._buffer.narrow(0, end - numel, numel).copy_(flat)
        else:
            self._held.append(flat)
        self._entries.append((group_index, param_index, self._filled, numel))
        self._filled += numel
        if self._filled >= self.bucket_numel:
            self._reduce_bucket()

    def has_arrived(self, group_index: int, param_index: int) -> bool:
        return (group_index, param_index) in self._arrived

    def flush(self) -> None:
        """End of backward: reduce the open bucket and wait for every reduction. A parameter that
        got no gradient is simply absent (DeepSpeed's `ignore_unused_parameters`)."""
        if self._entries:
            self._reduce_bucket()
        self.reducer.wait_all()
        self._bucket_slots.restart()
        self._arrived.clear()

    def _reduce_bucket(self) -> None:
        slices = self._owned_slices()
        # Usually the bucket is in owner order and is sent as it is ([Note: buckets fill from the
        # end]); its buffer is a reused slot ([Note: stage-2 scratch reuse]).
        self.reducer.reduce_to_owners(self._take_flat(), slices, self.accumulate)
        self._open_bucket()

    def _reduce_oversized(self, group_index: int, param_index: int, flat: torch.Tensor) -> None:
        """[Note: oversized gradients] A gradient larger than a bucket, reduced in near-equal pieces
        of at most `bucket_numel` elements (no small tail collective), each sent from the gradient
        itself when it is already in the communication dtype. Called with no bucket open."""
        numel = flat.numel()
        num_pieces = -(-numel // self.bucket_numel)
        bounds = [index * numel // num_pieces for index in range(num_pieces + 1)]
        for start, end in zip(bounds, bounds[1:]):
            slices = self._piece_slices(group_index, param_index, start, end - start)
            self.reducer.reduce_to_owners(self._piece_send(flat.narrow(0, start, end - start)), slices,
                                          self.accumulate)

    def _piece_send(self, piece: torch.Tensor) -> torch.Tensor:
        """What a piece of an oversized gradient is reduced from: the gradient's own elements (the
        reduction may scale or overwrite them in place, [Note: oversized gradients]) or, to change
        dtype, a copy in a bucket slot (without `contiguous_gradients`, a fresh one)."""
        if piece.dtype == self.comm_dtype and piece.is_contiguous():
            return piece
        if not self.contiguous_gradients:
            return piece.to(self.comm_dtype, copy=True)
        slot = self._bucket_slots.take(self.bucket_numel, self.comm_dtype, piece.device)
        return slot.narrow(0, 0, piece.numel()).copy_(piece)

    def _piece_slices(self, group_index: int, param_index: int, start: int, numel: int) -> list[OwnedSlice]:
        """Every owner's slice of elements [start, start + numel) of one parameter, in piece order."""
        slices = []
        for dp_rank, frag in self.owners[group_index][param_index]:
            low, high = max(frag.param_start, start), min(frag.param_start + frag.numel, start + numel)
            if low >= high:
                continue
            dest = None
            if dp_rank == self.reducer.dp_rank:
                dest = self.partitions[group_index].narrow(0, frag.partition_start + low - frag.param_start,
                                                           high - low)
            slices.append(OwnedSlice(dp_rank, low - start, high - low, dest))
        return sorted(slices, key=lambda s: s.bucket_offset)

    def _take_flat(self) -> torch.Tensor:
        if not self.contiguous_gradients:
            flat = torch.cat(self._held[::-1]).to(self.comm_dtype)
            self._held = []
            return flat
        assert self._buffer is not None
        buffer, self._buffer = self._buffer, None
        return buffer.narrow(0, buffer.numel() - self._filled, self._filled)

    def _owned_slices(self) -> list[OwnedSlice]:
        """Every owner's slice of the bucket, in bucket order (the reverse of arrival order)."""
        slices = []
        for group_index, param_index, before, numel in self._entries:
            offset = self._filled - before - numel
            for dp_rank, frag in self.owners[group_index][param_index]:
                dest = None
                if dp_rank == self.reducer.dp_rank:
                    dest = self.partitions[group_index].narrow(0, frag.partition_start, frag.numel)
                slices.append(OwnedSlice(dp_rank, offset + frag.param_start, frag.numel, dest))
        return sorted(slices, key=lambda s: s.bucket_offset)
