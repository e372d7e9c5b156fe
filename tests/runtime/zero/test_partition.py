"""The ZeRO 1/2 partition plan, without processes: layout, padding, fragments, slabs, chunks."""

import pytest

from zerospeed.runtime.zero.partition import (
    allgather_chunks,
    build_layout,
    owner_fragments,
    plan_slabs,
    round_robin_order,
    slab_real_numel,
)


@pytest.mark.parametrize("numels, world_size, padded", [
    ([3, 5, 1], 1, 10), ([3, 5, 1], 2, 12), ([3, 5, 1], 4, 16), ([8], 2, 8), ([7], 3, 12), ([], 2, 0),
])
def test_layout_pads_at_the_end_to_a_multiple_of_2w(numels, world_size, padded):
    layout = build_layout(numels, world_size)
    assert layout.padded_numel == padded
    assert layout.padding == padded - sum(numels)
    assert layout.partition_numel * world_size == padded


def test_padding_only_in_trailing_partitions():
    layout = build_layout([5], 4)          # 8 elements, partitions of 2: [0,2) [2,4) [4,6) [6,8)
    assert [layout.padding_in_partition(r) for r in range(4)] == [0, 0, 1, 2]


def test_fragments_cover_every_parameter_exactly_once():
    numels = [3, 7, 2, 9]
    layout = build_layout(numels, 3)       # 21 -> 24, partitions of 8
    owned = [0] * len(numels)
    for rank in range(3):
        frags = layout.fragments(rank)
        assert sum(f.numel for f in frags) == 8 - layout.padding_in_partition(rank)
        for frag in frags:
            assert layout.param_offsets[frag.param_index] + frag.param_start == \
                layout.partition_start(rank) + frag.partition_start
            owned[frag.param_index] += frag.numel
    assert owned == numels
    # parameter 1 (offsets 3..10) straddles the boundary at 8
    assert [(f.param_index, f.param_start, f.partition_start, f.numel) for f in layout.fragments(1)] == \
        [(1, 5, 0, 2), (2, 0, 2, 2), (3, 0, 4, 4)]


def test_round_robin_order():
    assert round_robin_order(5, 2) == [0, 2, 4, 1, 3]
    assert round_robin_order(3, 1) == [0, 1, 2]


def test_slabs_tile_the_partition_tail_first():
    slabs = plan_slabs(partition_numel=10, world_size=2, bucket_numel=8)
    assert [(s.offset, s.numel) for s in slabs] == [(6, 4), (2, 4), (0, 2)]
    assert [(s.offset, s.numel) for s in plan_slabs(10, 2, 10**9)] == [(0, 10)]
    assert len(plan_slabs(10, 4, 1)) == 10  # a tiny bucket still makes progress: one element per row


def test_owner_fragments_route_every_element_to_its_owner():
    numels = [3, 7, 2, 9]
    layout = build_layout(numels, 3)
    owners = owner_fragments(layout)
    assert [[rank for rank, _ in parts] for parts in owners] == [[0], [0, 1], [1], [1, 2]]
    for index, parts in enumerate(owners):
        assert sum(f.numel for _, f in parts) == numels[index]
        for rank, frag in parts:
            flat_start = layout.partition_start(rank) + frag.partition_start
            assert layout.param_offsets[index] + frag.param_start == flat_start


def test_slab_real_numel_counts_gradient_elements_only():
    layout = build_layout([3, 7, 2, 9], 3)   # 21 real of 24
    slabs = plan_slabs(layout.partition_numel, 3, bucket_numel=9)
    assert sum(slab_real_numel(layout, s) for s in slabs) == layout.numel
    assert slab_real_numel(layout, slabs[0]) == 3 + 3 + 0   # the tail rows; rank 2's are padding


def test_allgather_chunks():
    assert allgather_chunks(10, 2, 8) == [(0, 4), (4, 4), (8, 2)]
    assert allgather_chunks(10, 2, 10**9) == [(0, 10)]
    assert all(start % 2 == 0 for start, _ in allgather_chunks(101, 4, 30))
