"""The in-place collectives ([Note: gloo temporaries]): the all-gather keeps every bit (-0.0, NaN,
odd byte counts), the rows reduce-scatter gives each rank its row of the sum."""

import pytest
import torch
from distributed import run_on_ranks

from zerospeed import comm


def _gather_bits(dtype, numel, bitwise_or):
    from zerospeed.comm import comm as comm_module

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    pieces = [torch.tensor([-0.0, float("nan"), 1.5, -2.25, 3e-40])[:numel].to(dtype) * (r + 1)
              for r in range(world_size)]
    flat = torch.zeros(world_size * numel, dtype=dtype)
    flat[rank * numel:(rank + 1) * numel] = pieces[rank]
    backends = comm_module._BACKENDS_WITH_BITWISE_OR
    if not bitwise_or:   # NCCL's path (no bitwise OR) on gloo
        comm_module._BACKENDS_WITH_BITWISE_OR = frozenset()
    try:
        comm.all_gather_in_place(flat)
    finally:
        comm_module._BACKENDS_WITH_BITWISE_OR = backends
    return flat.view(torch.uint8), torch.cat(pieces).view(torch.uint8)


@pytest.mark.parametrize("bitwise_or", [True, False])
@pytest.mark.parametrize("dtype,numel", [(torch.float32, 5), (torch.bfloat16, 3), (torch.float16, 5)])
def test_all_gather_in_place_keeps_every_bit(dtype, numel, bitwise_or):
    for gathered, expected in run_on_ranks(_gather_bits, 2, dtype, numel, bitwise_or):
        assert torch.equal(gathered, expected)


def test_in_place_gather_needs_no_bitwise_or_on_nccl():
    from zerospeed.comm.comm import in_place_gather_op

    assert in_place_gather_op("nccl") == torch.distributed.ReduceOp.SUM
    assert in_place_gather_op("gloo") == torch.distributed.ReduceOp.BOR


def _rows():
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = torch.arange(world_size * 3, dtype=torch.float32).view(world_size, 3) * (rank + 1)
    work, mine = comm.reduce_scatter_rows_(rows, async_op=True)
    work.wait()
    total = sum(r + 1 for r in range(world_size))
    return mine, torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32) * total, comm.prefers_in_place()


def test_reduce_scatter_rows_gives_each_rank_its_row_of_the_sum():
    for mine, expected, in_place in run_on_ranks(_rows, 2):
        assert in_place  # the harness runs gloo
        assert torch.equal(mine, expected)


def _gathered_rows(members):
    """Rows [group size, 4] narrowed to 3 of 4 columns (rows contiguous, the whole not): each
    member's own row holds its shard, the rest garbage; afterwards every member holds every shard.
    The group is `members` (global ranks), so each row's source is a global rank other than its index."""
    rank = torch.distributed.get_rank()
    group = torch.distributed.new_group(members)
    if rank not in members:
        return None
    index = members.index(rank)
    full = torch.full((len(members), 4), float(rank + 100))
    full[index, :3] = torch.tensor([-0.0, float("nan"), 1.5]) * (index + 1)
    rows = full.narrow(1, 0, 3)
    comm.all_gather_rows_in_place(rows, group=group)
    expected = torch.stack([torch.tensor([-0.0, float("nan"), 1.5]) * (i + 1) for i in range(len(members))])
    return rows.view(torch.int32), expected.view(torch.int32), full[:, 3].clone()


@pytest.mark.parametrize("members", [[0, 1], [1, 2]])
def test_all_gather_rows_in_place_fills_every_row_bitwise(members):
    results = run_on_ranks(_gathered_rows, 3, members)
    for rank, result in enumerate(results):
        if rank not in members:
            continue
        gathered, expected, untouched = result
        assert torch.equal(gathered, expected)
        assert torch.equal(untouched, torch.full((len(members),), float(rank + 100)))   # columns outside
