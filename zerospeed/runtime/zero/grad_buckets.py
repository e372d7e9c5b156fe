"""Bucketed, optionally overlapped reduction of gradients into their owners' partitions (ZeRO 1/2).

A bucket is a `Slab` (partition.py, [Note: slab buckets]): `world_size` equal rows, row r being
the slice of rank r's partition at the slab's offsets. Reducing it is one equal-split
`reduce_scatter_tensor` (`reduce_scatter: true`) or one `all_reduce` after which each rank keeps
its own row (`reduce_scatter: false`; on gloo this is often the faster of the two). Either way
the bytes sent per step are the trainable (padded) gradient volume, once.

- `SlabReducer` runs the collectives in `communication_data_type` with DeepSpeed's averaging
  rules and, with `overlap_comm`, asynchronously with at most two reductions in flight (double
  buffering). It only ever calls `wait()` on a handle: on gloo an async reduce-scatter's
  `is_completed()` never turns true and it has no future.
- `GradientBuckets` (stage 2) takes each parameter's gradient as backward produces it, copies it
  into the slab rows it belongs to (`contiguous_gradients`; without it the gradient is held and
  copied when its slab is reduced) and reduces a slab as soon as all its rows are filled.
- `reduce_flat_gradients` (stage 1) reduces a full flat gradient buffer at the boundary.

[Note: stage 2 peak memory]
A slab has a row in every partition, so it fills only when backward has produced gradients from
all of the model's `world_size` parts; until then its rows wait in their buffer. Gradients are
freed as soon as they are copied, but up to about (W-1)/W of the gradient volume can be waiting
in slab buffers near the end of backward. What stays after backward is only this rank's
partition (the ZeRO-2 saving `memory_breakdown()` reports). Reducing buckets in production
order instead would need uneven splits (reduce to each owner), which a reduce-scatter lacks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.partition import GroupLayout, Slab, SlabPiece, param_pieces, slab_real_numel

__all__ = ["GradientBuckets", "SlabReducer", "averaging_factors", "reduce_flat_gradients"]

_MAX_IN_FLIGHT = 2


def averaging_factors(settings: PrecisionSettings, world_size: int) -> tuple[float, float]:
    """(before, after) multipliers around a sum reduction: the rules of `average_in_place` (§3.9),
    split so an asynchronous reduction can apply the second one after `wait()`."""
    if not settings.gradient_average:
        return 1.0, 1.0
    if settings.prescale_gradients:
        return 1.0 / world_size, 1.0
    factor = settings.gradient_predivide_factor
    return 1.0 / factor, (factor / world_size if factor != world_size else 1.0)


@dataclasses.dataclass
class _InFlight:
    handle: Any
    rows: torch.Tensor          # the input, kept alive until the collective is done
    output: torch.Tensor        # this rank's reduced row, communication dtype
    dest: torch.Tensor          # where the row goes (gradient partition slice)
    accumulate: bool


class SlabReducer:
    def __init__(self, group: Any, settings: PrecisionSettings, use_reduce_scatter: bool,
                 overlap_comm: bool) -> None:
        self.group = group
        self.dp_rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.use_reduce_scatter = use_reduce_scatter
        self.overlap_comm = overlap_comm
        self.before, self.after = averaging_factors(settings, self.world_size)
        self._in_flight: list[_InFlight] = []

    def reduce(self, rows: torch.Tensor, dest: torch.Tensor, accumulate: bool) -> None:
        """Sum `rows` ([W * n], communication dtype) over ranks into `dest` ([n]): add or copy."""
        if self.before != 1.0:
            rows.mul_(self.before)
        row_numel = rows.numel() // self.world_size
        if self.use_reduce_scatter:
            output = torch.empty(row_numel, dtype=rows.dtype, device=rows.device)
            handle = comm.reduce_scatter_tensor(output, rows, group=self.group, async_op=self.overlap_comm)
        else:
            handle = comm.all_reduce(rows, group=self.group, async_op=self.overlap_comm)
            output = rows.narrow(0, self.dp_rank * row_numel, row_numel)
        self._in_flight.append(_InFlight(handle, rows, output, dest, accumulate))
        while len(self._in_flight) > (_MAX_IN_FLIGHT if self.overlap_comm else 0):
            self._finish(self._in_flight.pop(0))

    def wait_all(self) -> None:
        while self._in_flight:
            self._finish(self._in_flight.pop(0))

    def _finish(self, work: _InFlight) -> None:
        if work.handle is not None:
            work.handle.wait()
        if self.after != 1.0:
            work.output.mul_(self.after)
        if work.accumulate:
            work.dest.add_(work.output)
        else:
            work.dest.copy_(work.output)


def reduce_flat_gradients(flat_grad: torch.Tensor, layout: GroupLayout, slabs: list[Slab],
                          reducer: SlabReducer, comm_dtype: torch.dtype) -> None:
    """Stage 1 at the boundary: reduce a full flat gradient buffer; this rank's partition of it
    then holds the reduced (averaged) gradients. Other partitions keep stale values."""
    rows_view = flat_grad.view(layout.world_size, layout.partition_numel)
    for slab in slabs:
        if slab_real_numel(layout, slab) == 0:
            continue  # pure padding: zeros on every rank
        window = rows_view.narrow(1, slab.offset, slab.numel)
        rows = torch.empty(window.shape, dtype=comm_dtype, device=flat_grad.device)
        rows.copy_(window)
        reducer.reduce(rows.view(-1), rows_view[reducer.dp_rank].narrow(0, slab.offset, slab.numel),
                       accumulate=False)
    reducer.wait_all()


class GradientBuckets:
    """Stage 2: per-parameter gradients into slab rows, each full slab reduced into the partition."""

    def __init__(self, layouts: list[GroupLayout], slabs: list[list[Slab]],
                 partitions: list[torch.Tensor], reducer: SlabReducer, comm_dtype: torch.dtype,
                 contiguous_gradients: bool) -> None:
        self.layouts = layouts
        self.slabs = slabs
        self.partitions = partitions          # this rank's gradient partition per group (accumulated)
        self.reducer = reducer
        self.comm_dtype = comm_dtype
        self.contiguous_gradients = contiguous_gradients
        self.pieces = [param_pieces(layout, group_slabs) for layout, group_slabs in zip(layouts, slabs)]
        self.real_numel = [[slab_real_numel(layout, s) for s in group_slabs]
                           for layout, group_slabs in zip(layouts, slabs)]
        self._reset()

    def _reset(self) -> None:
        self._remaining = [list(numels) for numels in self.real_numel]
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._held: dict[tuple[int, int], torch.Tensor] = {}     # gradients not yet copied
        self._arrived: set[tuple[int, int]] = set()
        self._launched: set[tuple[int, int]] = set()

    @property
    def busy(self) -> bool:
        return bool(self._arrived)

    def add_grad(self, group_index: int, param_index: int, grad: torch.Tensor) -> None:
        key = (group_index, param_index)
        if key in self._arrived:
            raise RuntimeError("Gradient computed twice for this partition: a parameter's gradient was "
                               "produced twice before the backward epilogue (ZeRO stage 2 reduces each "
                               "gradient once per backward; no_sync is not supported at stage 2).")
        self._arrived.add(key)
        flat = grad.detach().reshape(-1)
        if not self.contiguous_gradients:
            self._held[key] = flat
        ready = []
        for piece in self.pieces[group_index][param_index]:
            if self.contiguous_gradients:
                self._copy_piece(group_index, piece, flat)
            remaining = self._remaining[group_index]
            remaining[piece.slab_index] -= piece.numel
            if remaining[piece.slab_index] == 0:
                ready.append(piece.slab_index)
        for slab_index in ready:
            self._launch(group_index, slab_index)

    def flush(self) -> None:
        """End of backward: reduce the slabs still open (gradients never produced count as zeros,
        DeepSpeed's `ignore_unused_parameters`), in slab order so every rank issues the same calls."""
        for group_index, group_slabs in enumerate(self.slabs):
            for slab in group_slabs:
                key = (group_index, slab.index)
                if key not in self._launched and self.real_numel[group_index][slab.index] > 0:
                    self._launch(group_index, slab.index)
        self.reducer.wait_all()
        self._reset()

    def _row(self, group_index: int, slab_index: int, dp_rank: int) -> torch.Tensor:
        key = (group_index, slab_index)
        buffer = self._buffers.get(key)
        if buffer is None:
            slab = self.slabs[group_index][slab_index]
            layout = self.layouts[group_index]
            buffer = torch.zeros(layout.world_size, slab.numel, dtype=self.comm_dtype,
                                 device=self.partitions[group_index].device)
            self._buffers[key] = buffer
        return buffer[dp_rank]

    def _copy_piece(self, group_index: int, piece: SlabPiece, flat_grad: torch.Tensor) -> None:
        row = self._row(group_index, piece.slab_index, piece.dp_rank)
        row.narrow(0, piece.row_offset, piece.numel).copy_(flat_grad.narrow(0, piece.param_start, piece.numel))

    def _launch(self, group_index: int, slab_index: int) -> None:
        key = (group_index, slab_index)
        self._launched.add(key)
        if not self.contiguous_gradients:
            self._copy_held(group_index, slab_index)
        self._row(group_index, slab_index, 0)  # allocates a zero buffer if nothing arrived
        rows = self._buffers.pop(key)
        slab = self.slabs[group_index][slab_index]
        dest = self.partitions[group_index].narrow(0, slab.offset, slab.numel)
        self.reducer.reduce(rows.view(-1), dest, accumulate=True)

    def _copy_held(self, group_index: int, slab_index: int) -> None:
        for (held_group, param_index), flat in list(self._held.items()):
            if held_group != group_index:
                continue
            pieces = self.pieces[group_index][param_index]
            for piece in pieces:
                if piece.slab_index == slab_index:
                    self._copy_piece(group_index, piece, flat)
            if all((group_index, p.slab_index) in self._launched for p in pieces):
                del self._held[(held_group, param_index)]
