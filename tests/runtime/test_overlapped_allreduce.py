"""Stage 0's overlapped all-reduce reuses its flat buffers ([Note: reused flat buffers]).

Many small buckets over 2 gloo ranks and several steps: every gradient equals the average of the
ranks' gradients, computed here in one process, and the buckets cycle through a fixed pair of slabs
allocated once. A slab overwritten while its previous bucket is still in flight would corrupt the
averages of that earlier bucket.
"""

import torch

from distributed import run_on_ranks
from zerospeed.runtime.overlapped_allreduce import MAX_IN_FLIGHT_BUCKETS, OverlappedAllReduce
from zerospeed.runtime.precision import PrecisionSettings

SHAPES = [(7, 5), (11,), (3, 4, 2), (13,), (6, 6), (9,), (2, 17)]
NUM_STEPS = 3


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _reduce_steps(bucket_numel: int):
    rank = torch.distributed.get_rank()
    params = [torch.zeros(shape) for shape in SHAPES]
    reducer = OverlappedAllReduce(params, bucket_numel, None, PrecisionSettings())
    results, slab_pointers = [], set()
    for step in range(NUM_STEPS):
        grads = _grads(rank, step)
        grad_of = grads.__getitem__
        for index in reversed(range(len(params))):  # backward's order: last registered first
            reducer.mark_ready(index, grad_of)
        reducer.finish(grad_of)
        results.append(grads)
        slab_pointers.update(buffer.data_ptr() for buffer in reducer._flat_buffers.allocated())
    return results, len(reducer.buckets), len(slab_pointers)


def test_buckets_cycle_through_reused_slabs_and_average_exactly():
    per_rank = run_on_ranks(_reduce_steps, 2, 30)
    for results, num_buckets, num_slabs in per_rank:
        assert num_buckets >= 4  # enough buckets that every slab is reused within a step
        assert num_slabs == MAX_IN_FLIGHT_BUCKETS
        for step, grads in enumerate(results):
            expected = [(a + b) / 2 for a, b in zip(_grads(0, step), _grads(1, step))]
            for got, want in zip(grads, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
