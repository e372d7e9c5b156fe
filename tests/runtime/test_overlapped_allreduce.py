"""Stage 0's overlapped all-reduce: gradients are views of persistent buckets, reduced in place
([Note: gradients as bucket views] in overlapped_allreduce.py).

Many small buckets over 2 gloo ranks and several steps of two micro-batches each, gradients
produced by real autograd: every gradient equals the average of the ranks' accumulated gradients,
computed here in one process with the same operations (so exactly, in fp32), every `.grad` is a
view of the reducer's one flat tensor, the same memory every step, and nothing is copied into or
out of a gradient. A gradient the user replaced or cleared mid-window is copied into its slot (as
DDP does). With a communication dtype other than the gradients', buckets are converted into a
fixed pair of buffers, each reused while an earlier bucket may be in flight.
"""

import pytest
import torch

from copy_counter import CopyCounter
from distributed import run_on_ranks
from zerospeed.runtime.overlapped_allreduce import MAX_IN_FLIGHT_BUCKETS, OverlappedAllReduce
from zerospeed.runtime.precision import PrecisionSettings

SHAPES = [(7, 5), (11,), (3, 4, 2), (13,), (6, 6), (9,), (2, 17)]
NUM_STEPS, NUM_MICRO = 3, 2


def _grads(rank: int, step: int, micro: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _accumulated(rank: int, step: int, clear_after_first: bool = False) -> list[torch.Tensor]:
    """What autograd accumulates on `rank` over a step's micro-batches (0 + g0 + g1, in that order)."""
    micros = range(1, NUM_MICRO) if clear_after_first else range(NUM_MICRO)
    totals = [torch.zeros(shape) for shape in SHAPES]
    for micro in micros:
        for total, grad in zip(totals, _grads(rank, step, micro)):
            total += grad
    return totals


def _reduce_steps(bucket_numel: int, comm_dtype: torch.dtype, interfere: bool):
    """Per step: the gradients after `finish()`, whether each `.grad` was its view, the flat's
    storage, copies touching it, and the conversion buffers' storages."""
    rank = torch.distributed.get_rank()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    reducer = OverlappedAllReduce(params, bucket_numel, None, PrecisionSettings(communication_dtype=comm_dtype))
    boundary = [False]   # the hooks launch buckets on the window's last micro-batch only

    def hook(index: int):
        return lambda _: reducer.mark_ready(index) if boundary[0] else None

    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(hook(index))
    steps = []
    for step in range(NUM_STEPS):
        reducer.start_window()
        flat = reducer.grad_buffers()[0]
        counter = CopyCounter({flat.untyped_storage().data_ptr()})
        with counter:
            for micro in range(NUM_MICRO):
                if interfere and micro == 1:   # the user clears one gradient and replaces another
                    params[0].grad = None
                    params[3].grad = torch.zeros(SHAPES[3])
                    for param in params[1:3] + params[4:]:
                        param.grad.zero_()
                boundary[0] = micro == NUM_MICRO - 1
                grads = _grads(rank, step, micro)
                sum((param * grad).sum() for param, grad in zip(params, grads)).backward()
            reducer.finish()
        steps.append({"grads": [p.grad.clone() for p in params],
                      "are_views": [p.grad is view for p, view in zip(params, reducer.views())],
                      "flat": flat.untyped_storage().data_ptr(), "copies": counter.count,
                      "buffers": {b.data_ptr() for b in reducer.flat_buffers()}})
        for param in params:   # zero_grad(set_to_none=True)
            param.grad = None
    return steps, len(reducer.buckets)


@pytest.mark.parametrize("interfere", [False, True], ids=["autograd", "user-cleared"])
def test_gradients_are_bucket_views_reduced_in_place_exactly(interfere):
    per_rank = run_on_ranks(_reduce_steps, 2, 30, torch.float32, interfere)
    for steps, num_buckets in per_rank:
        assert num_buckets >= 4
        assert len({s["flat"] for s in steps}) == 1            # one flat tensor, kept for the run
        for step, got in enumerate(steps):
            assert all(got["are_views"])
            assert got["copies"] == (2 if interfere else 0)    # the two foreign gradients only
            expected = [(a + b) * 0.5 for a, b in zip(_accumulated(0, step, interfere),
                                                      _accumulated(1, step, interfere))]
            for value, want in zip(got["grads"], expected):
                assert torch.equal(value, want)


def test_buckets_cycle_through_reused_conversion_buffers():
    per_rank = run_on_ranks(_reduce_steps, 2, 30, torch.bfloat16, False)
    for steps, num_buckets in per_rank:
        assert num_buckets >= 4   # enough buckets that every buffer is reused within a step
        assert len(set().union(*(s["buffers"] for s in steps))) == MAX_IN_FLIGHT_BUCKETS
        for step, got in enumerate(steps):
            expected = [((a.bfloat16() + b.bfloat16()) * 0.5).float()
                        for a, b in zip(_accumulated(0, step), _accumulated(1, step))]
            for value, want in zip(got["grads"], expected):
                torch.testing.assert_close(value, want, rtol=2 ** -8, atol=1e-6)
