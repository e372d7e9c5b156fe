"""Stage 2 (and stage 1 with `overlap_comm`) with parameters larger than a bucket ([Note: oversized gradients] in grad_buckets.py).

TinyLM's weights (66, 42 and 42 elements) are all larger than the 8-element buckets used here; its
biases (7 and 6) fill buckets as usual. Each run is compared bit for bit with one that reduces
everything in one bucket: a piece reduces the same elements with the same arithmetic, so the
bucket size changes no number.
"""

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from test_stage_1_and_2 import _build, _train

from zerospeed.runtime.precision import PrecisionSettings

BUCKET, WORLD_SIZE = 8, 2

CASES = {
    "reduce-scatter": {},
    "reduce-scatter-overlap": {"overlap_comm": True},
    "all-reduce": {"reduce_scatter": False},
    "all-reduce-overlap": {"reduce_scatter": False, "overlap_comm": True},
    "noncontiguous-overlap": {"contiguous_gradients": False, "overlap_comm": True},
    "fp16-communication": {"communication_dtype": torch.float16},
    "bf16-communication-overlap": {"communication_dtype": torch.bfloat16, "overlap_comm": True},
    # stage 1 buckets its boundary backward with overlap_comm: the pieces overwrite its flat buffer
    "stage1-overlap": {"stage": 1, "overlap_comm": True},
    "stage1-overlap-all-reduce": {"stage": 1, "overlap_comm": True, "reduce_scatter": False},
}


def _trained(bucket, zero):
    zero = dict(zero)
    precision = PrecisionSettings(communication_dtype=zero.pop("communication_dtype", torch.float32))
    model, optimizer = _build(zero.pop("stage", 2), precision=precision, reduce_bucket_size=bucket, **zero)
    losses, _ = _train(model, optimizer, gas=2, num_steps=3)
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    reducer = optimizer.reducer
    sizes = {"bucket": [b.numel() for b in optimizer.buckets._bucket_slots.allocated()],
             "received": [b.numel() for b in reducer._received.allocated()],
             "summed": [b.numel() for b in reducer._summed.allocated()]}
    return losses, params, sizes


def _pieces_and_one_bucket(zero):
    assert dist.get_world_size() == WORLD_SIZE
    return _trained(BUCKET, zero), _trained(500_000_000, zero)


@pytest.mark.parametrize("case", list(CASES))
def test_oversized_gradients_keep_scratch_within_a_bucket_and_every_bit(case):
    for (losses, params, sizes), (one_losses, one_params, _) in run_on_ranks(_pieces_and_one_bucket, WORLD_SIZE,
                                                                            CASES[case]):
        assert losses == one_losses
        for name, expected in one_params.items():
            assert torch.equal(params[name], expected), name
        # the receive buffer holds every rank's copy of the owned slices: W buckets when one rank owns all
        assert all(n <= BUCKET for n in sizes["bucket"] + sizes["summed"]), sizes
        assert all(n <= WORLD_SIZE * BUCKET for n in sizes["received"]), sizes
        assert bool(sizes["received"]) == CASES[case].get("reduce_scatter", True), sizes   # all-reduce: in place


def _bucket_buffers_when_every_param_is_oversized(zero):
    model, optimizer = _build(2, reduce_bucket_size=5, **zero)
    _train(model, optimizer, gas=2, num_steps=2)
    return len(optimizer.buckets._bucket_slots.allocated())


@pytest.mark.parametrize("overlap_comm", [True, False])
def test_an_oversized_gradient_is_sent_without_a_bucket_copy(overlap_comm):
    """Every parameter larger than a bucket, gradients already in the communication dtype: each
    piece is reduced from the gradient itself, so no bucket buffer is ever allocated."""
    assert run_on_ranks(_bucket_buffers_when_every_param_is_oversized, WORLD_SIZE,
                        {"overlap_comm": overlap_comm}) == [0, 0]
