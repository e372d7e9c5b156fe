"""Stage 3 reduces gradients in two fixed slabs reused every step ([Note: gradient slabs])."""

import pytest
import torch
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

import zerospeed
from zerospeed.runtime.zero.stage3_slabs import GradientSlabs, slab_capacity


class _Param:
    """What a slab reads of a parameter: its partition size over `world_size` ranks."""

    def __init__(self, numel, world_size):
        self.numel, self.world_size = numel, world_size

    def partition_numel(self):
        return -(-self.numel // self.world_size)


def _reference_rows(grads, world_size):
    """The one-bucket layout: row r is every parameter's r-th chunk, zero-padded."""
    rows = []
    for rank in range(world_size):
        pieces = []
        for grad in grads:
            size = -(-grad.numel() // world_size)
            chunk = grad[rank * size:(rank + 1) * size]
            pieces.append(torch.cat([chunk, torch.zeros(size - chunk.numel())]))
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def _fill(slabs, grads, world_size):
    """The reducer's loop (stage3_gradients.py) without the collective: the rows each slab reduces."""
    reduced, slab = [], None
    for grad in grads:
        param, column = _Param(grad.numel(), world_size), 0
        while column < param.partition_numel():
            slab = slab or slabs.open(world_size, None, grad.device)
            column += slab.write(param, grad, column)
            if slab.free_columns == 0:
                reduced.append((slabs.rows_to_reduce(slab).clone(), slab.pieces))
                slab = None
    if slab is not None:
        rows = slabs.rows_to_reduce(slab)
        assert rows.is_contiguous() and rows.shape == (world_size, slab.filled)
        reduced.append((rows.clone(), slab.pieces))
    return reduced


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_slabs_cut_the_one_bucket_layout_into_column_ranges(world_size):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=generator) for n in (7, 3, 40, 1, 9)]
    slabs = GradientSlabs(10, torch.float32, max_world_size=world_size)
    reduced = _fill(slabs, grads, world_size)
    assert torch.equal(torch.cat([rows for rows, _ in reduced], dim=1), _reference_rows(grads, world_size))
    assert all(rows.numel() <= max(10, world_size) for rows, _ in reduced)
    columns = [(piece.column, piece.numel) for _, pieces in reduced for piece in pieces]
    assert sum(numel for _, numel in columns) == sum(-(-g.numel() // world_size) for g in grads)
    # a second step fills the same two buffers again: nothing is allocated per step
    buffers = {b.data_ptr() for b in slabs.allocated()}
    _fill(slabs, grads, world_size)
    assert {b.data_ptr() for b in slabs.allocated()} == buffers and slabs.nbytes() <= 2 * 4 * max(10, world_size)


def _train(cap, overlap_comm):
    """Stage 3 on TinyMLP with slabs of `cap` elements: losses, parameters, the reduced rows' shapes
    and storages."""
    import zerospeed.runtime.zero.stage3_gradients as stage3_gradients

    calls = []
    native = zerospeed.comm.reduce_scatter_rows_

    def recording(rows, *args, **kwargs):
        calls.append((tuple(rows.shape), rows.untyped_storage().data_ptr()))
        return native(rows, *args, **kwargs)

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    default_cap, stage3_gradients.MAX_BUCKET_NUMEL = stage3_gradients.MAX_BUCKET_NUMEL, cap
    zerospeed.comm.reduce_scatter_rows_ = recording
    try:
        config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "overlap_comm": overlap_comm, "param_persistence_threshold": 0}}
        engine, *_ = zerospeed.initialize(model=make_model(), config=config)
        losses = []
        for batch in global_batches(3, 8):
            loss = engine(*micro_batch(batch, 0, rank, 8 // world_size, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        padded = sum(p.partition_numel() * world_size for p in engine.module.parameters())
        with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
    finally:
        stage3_gradients.MAX_BUCKET_NUMEL = default_cap
        zerospeed.comm.reduce_scatter_rows_ = native
    return losses, params, calls, padded


def _slabs_against_one_bucket(overlap_comm):
    one_bucket = _train(1 << 22, overlap_comm)
    return one_bucket, _train(64, overlap_comm)


@pytest.mark.parametrize("overlap_comm", [False, True])
def test_small_slabs_give_the_one_bucket_result_bit_for_bit(overlap_comm):
    for (losses1, params1, calls1, padded), (losses, params, calls, _) in \
            run_on_ranks(_slabs_against_one_bucket, 2, overlap_comm):
        assert len(calls1) == 3 and all(shape[0] * shape[1] == padded for shape, _ in calls1)
        assert losses == losses1 and all(torch.equal(a, b) for a, b in zip(params, params1))
        assert len(calls) > 3 * 5 and all(shape[0] == 2 and shape[0] * shape[1] <= 64 for shape, _ in calls)
        assert sum(shape[0] * shape[1] for shape, _ in calls) == 3 * padded   # no padding columns sent
        assert len({storage for _, storage in calls}) == 2   # the same two buffers every step


def test_slab_capacity_is_an_eighth_of_the_model_within_its_bounds():
    cap = 1 << 22
    assert slab_capacity(500_000_000, cap, 1000) == 1000              # a model smaller than a slab
    assert slab_capacity(500_000_000, cap, 7_250_000) == 1 << 20      # wide4: an eighth is under 1M
    assert slab_capacity(500_000_000, cap, 24_000_000) == 3_000_000   # an eighth
    assert slab_capacity(500_000_000, cap, 49_560_000) == cap         # wide10: the cap
    assert slab_capacity(200_000, cap, 49_560_000) == 200_000         # reduce_bucket_size rules below
