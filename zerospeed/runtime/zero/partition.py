"""The ZeRO 1/2 partition plan: pure arithmetic over parameter sizes, no tensors, no processes.

[Note: flat layout]
Each optimizer param group's trainable parameters are laid end to end in one flat buffer, in group
order (or the round-robin order, `round_robin_order`), then padded with zeros at the end to a
multiple of `alignment * world_size` elements (DeepSpeed's `nccl_start_alignment_factor` of 2), so
the buffer splits into `world_size` equal partitions: rank r owns flat elements
`[r * partition_numel, (r + 1) * partition_numel)`. Only the trailing rank(s) hold padding. A
parameter may straddle a partition boundary; the part of it a rank owns is a `Fragment`.

[Note: slab buckets]
A full flat gradient buffer (stage 1, at the boundary) is reduced in slabs whose reduction is a
true equal-split reduce-scatter: slab k covers the same partition offsets `[offset, offset +
numel)` on every rank, so its input is `world_size` rows of `numel` elements and rank r receives
exactly the slice of its own partition; a slab holds at most `reduce_bucket_size` elements in all
rows together. Stage 2 cannot use slabs: a slab needs gradients from every partition, and rank
0's part of the model (the embedding, often tied and so finished last) arrives at the very end of
backward, so every slab would wait for it. Stage 2 buckets gradients in the order backward
produces them and routes each slice to its owner with `owner_fragments` (grad_buckets.py).
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "Fragment",
    "GroupLayout",
    "Slab",
    "allgather_chunks",
    "build_layout",
    "owner_fragments",
    "plan_slabs",
    "round_robin_order",
    "slab_real_numel",
]

NCCL_START_ALIGNMENT_FACTOR = 2


@dataclasses.dataclass(frozen=True)
class Fragment:
    """The part of parameter `param_index` that one rank owns."""

    param_index: int
    param_start: int        # first owned element, inside the flattened parameter
    partition_start: int    # where it lies, relative to the start of the rank's partition
    numel: int


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One param group's flat buffer: parameter offsets, padding and the equal rank partitions."""

    param_numels: tuple[int, ...]
    param_offsets: tuple[int, ...]
    world_size: int
    padded_numel: int

    @property
    def numel(self) -> int:
        return sum(self.param_numels)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def partition_numel(self) -> int:
        return self.padded_numel // self.world_size

    def partition_start(self, dp_rank: int) -> int:
        return dp_rank * self.partition_numel

    def padding_in_partition(self, dp_rank: int) -> int:
        """Padded elements inside this rank's partition (DeepSpeed's `groups_padding`)."""
        start = self.partition_start(dp_rank)
        real_end = min(self.numel, start + self.partition_numel)
        return self.partition_numel - max(0, real_end - start)

    def fragments(self, dp_rank: int) -> list[Fragment]:
        """The parameter parts inside this rank's partition, in flat order."""
        start = self.partition_start(dp_rank)
        end = start + self.partition_numel
        found = []
        for index, (offset, numel) in enumerate(zip(self.param_offsets, self.param_numels)):
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                found.append(Fragment(index, lo - offset, lo - start, hi - lo))
        return found


def round_robin_order(num_params: int, world_size: int) -> list[int]:
    """DeepSpeed's `round_robin_gradients` order: parameter k goes to list k mod W; lists concatenated."""
    return [index for first in range(world_size) for index in range(first, num_params, world_size)]


def build_layout(param_numels: list[int], world_size: int,
                 alignment: int = NCCL_START_ALIGNMENT_FACTOR) -> GroupLayout:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    offsets, total = [], 0
    for numel in param_numels:
        offsets.append(total)
        total += numel
    multiple = alignment * world_size
    padded = -(-total // multiple) * multiple
    return GroupLayout(tuple(param_numels), tuple(offsets), world_size, padded)


@dataclasses.dataclass(frozen=True)
class Slab:
    """Reduce bucket `index`: partition offsets `[offset, offset + numel)` on every rank."""

    index: int
    offset: int
    numel: int


def plan_slabs(partition_numel: int, world_size: int, bucket_numel: int) -> list[Slab]:
    """Split the partitions into slabs of at most `bucket_numel` elements (all rows), tail first."""
    if bucket_numel < 1:
        raise ValueError(f"reduce_bucket_size must be positive, got {bucket_numel}")
    row_numel = max(1, bucket_numel // world_size)
    slabs: list[Slab] = []
    end = partition_numel
    while end > 0:
        start = max(0, end - row_numel)
        slabs.append(Slab(len(slabs), start, end - start))
        end = start
    return slabs


def owner_fragments(layout: GroupLayout) -> list[list[tuple[int, Fragment]]]:
    """For each parameter (flat order), its `(dp_rank, fragment)` parts: who owns which slice."""
    owners: list[list[tuple[int, Fragment]]] = [[] for _ in layout.param_numels]
    for dp_rank in range(layout.world_size):
        for fragment in layout.fragments(dp_rank):
            owners[fragment.param_index].append((dp_rank, fragment))
    return owners


def slab_real_numel(layout: GroupLayout, slab: Slab) -> int:
    """Elements of the slab (all rows) that hold gradients rather than padding."""
    total = 0
    for dp_rank in range(layout.world_size):
        start = layout.partition_start(dp_rank) + slab.offset
        total += max(0, min(layout.numel, start + slab.numel) - start)
    return total


def allgather_chunks(partition_numel: int, world_size: int, bucket_numel: int) -> list[tuple[int, int]]:
    """(offset, numel) chunks of the partition for the post-step all-gather; each gathers
    `world_size * numel <= allgather_bucket_size` elements, chunk starts 2-element aligned."""
    row_numel = max(NCCL_START_ALIGNMENT_FACTOR, (bucket_numel // world_size) // 2 * 2)
    return [(start, min(row_numel, partition_numel - start))
            for start in range(0, partition_numel, row_numel)]
