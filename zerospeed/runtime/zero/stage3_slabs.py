"""`GradientSlabs`: stage 3's reduce-scatter inputs, built in two fixed buffers reused every step.

[Note: gradient slabs]
A stage-3 reduce-scatter input is `W` rows, row r the concatenation of each parameter's r-th
chunk ([Note: gradient path] in stage3_gradients.py). The rows are not allocated per bucket: each
gradient is copied, as its hook fires, into the open `Slab`, `W` rows of `width` columns in a
buffer allocated once. A parameter's chunks fill the next free columns of every row; a chunk wider
than what is left is split and continues in the next slab, so every slab but the last of a
backward is reduced exactly full, and the caller frees the full gradient as soon as it is copied.

Two buffers ([Note: reused flat buffers] in reused_buffers.py) take turns: one filling while the other's reduction may still be in flight
(`overlap_comm`; the caller keeps at most one in flight, so the buffer it opens next is free).
A slab reduced before it is full (the end of backward, a change of process group) has its rows
`width` apart where the reduce-scatter needs them `filled` apart: it is copied, compacted, into
the other buffer (at most one slab per reduction group per backward), so the collective carries
exactly the gradients, no padding columns.

Size (`slab_capacity`): `reduce_bucket_size` elements, capped at `MAX_BUCKET_NUMEL` (grad_buckets.py;
16 MiB in fp32), at an eighth of the model's padded size but not below `MIN_SLAB_NUMEL` (1M
elements), and at the model's padded size. The eighth: two 16 MiB slabs on a model whose whole
gradient is 29 MiB (issue 21's `wide4`) were the stage's margin over FSDP2's peak; 1M-element slabs
there measured a 34 MiB lower peak and 8% less CPU a step, while on `wide10` (49.6M parameters)
1M-element slabs cost 6-10% more CPU (four times the collectives), so large models keep 4M. Why: with DeepSpeed's default `reduce_bucket_size` (5e8)
a per-bucket rows buffer was the whole model, allocated at the end of every backward after every
full gradient had been held through it, and on a CPU its fresh pages were faulted in one by one
every step (issue 21, `wide10`: 48k minor faults per step, 189 MiB). Now the buffers' pages are
touched in the first step and reused; the reduction's memory is two slabs whatever the model.
For two ranks the sums are those of one large bucket bit for bit (a + b per element, whatever
the collective's chunking); with more ranks a ring all-reduce's order of addition may depend on
the buffer's size, as it does for any bucket size.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from zerospeed.runtime.reused_buffers import ReusedBuffers
from zerospeed.runtime.zero.param_state import ZeroParameter, rank_span

__all__ = ["GradientSlabs", "MIN_SLAB_NUMEL", "Slab", "SlabPiece", "slab_capacity"]

# A slab is at least this many elements (unless the model is smaller) ...
MIN_SLAB_NUMEL = 1 << 20
# ... and otherwise at most this fraction of the model, so a backward fills several slabs and the
# reduction of one overlaps the filling of the next.
SLABS_PER_MODEL = 8


def slab_capacity(reduce_bucket_numel: int, max_bucket_numel: int, padded_numel: int) -> int:
    """Elements per slab ([Note: gradient slabs], "Size")."""
    share = max(MIN_SLAB_NUMEL, -(-padded_numel // SLABS_PER_MODEL))
    return max(1, min(reduce_bucket_numel, max_bucket_numel, share, padded_numel))


class SlabPiece(NamedTuple):
    """Columns `[column, column + numel)` of `param`'s partition sit in the slab, in piece order."""

    param: ZeroParameter
    column: int
    numel: int


@dataclasses.dataclass(eq=False)
class Slab:
    """An open slab: `rows` ([W, width], a view of one reused buffer), filled up to `filled` columns."""

    rows: torch.Tensor
    buffer_index: int
    group: object
    pieces: list[SlabPiece] = dataclasses.field(default_factory=list)
    filled: int = 0

    @property
    def free_columns(self) -> int:
        return self.rows.shape[1] - self.filled

    def write(self, param: ZeroParameter, flat_grad: torch.Tensor, column: int) -> int:
        """Copy columns from `column` on of `param`'s W chunks of `flat_grad` (zero padding past a
        chunk's real end), as many as fit; returns how many."""
        world_size = self.rows.shape[0]
        size = param.partition_numel()
        numel = min(size - column, self.free_columns)
        end = column + numel
        if flat_grad.numel() == size * world_size:   # no padding: every rank's columns in one copy
            self.rows.narrow(1, self.filled, numel).copy_(flat_grad.view(world_size, size).narrow(1, column, numel))
            self.pieces.append(SlabPiece(param, column, numel))
            self.filled += numel
            return numel
        for rank in range(world_size):
            start, real = rank_span(flat_grad.numel(), world_size, rank)
            row = self.rows[rank]
            copied = max(0, min(end, real) - column)
            if copied:
                row.narrow(0, self.filled, copied).copy_(flat_grad.narrow(0, start + column, copied))
            if copied < numel:
                row.narrow(0, self.filled + copied, numel - copied).zero_()
        self.pieces.append(SlabPiece(param, column, numel))
        self.filled += numel
        return numel


class GradientSlabs:
    """The two buffers slabs are opened in ([Note: gradient slabs]), taken from a `ReusedBuffers`."""

    def __init__(self, capacity_numel: int, dtype: torch.dtype, device: torch.device | None = None,
                 max_world_size: int = 1) -> None:
        """Each buffer holds `capacity_numel` elements, and at least one column of
        `max_world_size` rows. `device`: allocate both now (see below); None: on the first
        gradient's device."""
        if capacity_numel < 1:
            raise ValueError(f"slab capacity must be positive, got {capacity_numel}")
        self.capacity_numel = max(capacity_numel, max_world_size)
        self._buffers = ReusedBuffers([self.capacity_numel] * 2, dtype)
        self._last_reduced = 1      # the buffer holding the rows reduced last (maybe in flight)
        if device is not None:
            # at set-up, not amid the first backward's activations: a buffer that outlives the
            # step, placed by malloc above their freed memory, would keep the heap from shrinking
            for index in (0, 1):
                self._buffers.get(index, device)

    def open(self, world_size: int, group: object, device: torch.device) -> Slab:
        """A slab over `world_size` ranks in the buffer not reduced last."""
        index = 1 - self._last_reduced
        buffer = self._buffer(index, world_size, device)
        width = buffer.numel() // world_size
        return Slab(buffer.narrow(0, 0, world_size * width).view(world_size, width), index, group)

    def rows_to_reduce(self, slab: Slab) -> torch.Tensor:
        """`slab`'s rows as a contiguous [W, filled] tensor: its own rows when full, else compacted
        into the other buffer, which the caller has let finish its reduction."""
        self._last_reduced = slab.buffer_index
        if slab.free_columns == 0:
            return slab.rows
        world_size = slab.rows.shape[0]
        index = 1 - slab.buffer_index
        target = self._buffer(index, world_size, slab.rows.device)
        rows = target.narrow(0, 0, world_size * slab.filled).view(world_size, slab.filled)
        rows.copy_(slab.rows.narrow(1, 0, slab.filled))
        self._last_reduced = index
        return rows

    def _buffer(self, index: int, world_size: int, device: torch.device) -> torch.Tensor:
        if world_size > self.capacity_numel:
            raise ValueError(f"a slab over {world_size} ranks needs at least {world_size} elements; "
                             f"these slabs hold {self.capacity_numel} (max_world_size too small)")
        return self._buffers.get(index, device)

    def allocated(self) -> list[torch.Tensor]:
        return self._buffers.allocated()

    def nbytes(self) -> int:
        return self._buffers.nbytes()
