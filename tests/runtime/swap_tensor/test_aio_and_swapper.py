"""The I/O engine and the optimizer swapper on their own: byte-exact transfers, bounded buffers,
read-ahead / write-behind ordering, files removed at close."""

import os

import pytest
import torch

from zerospeed.runtime.swap_tensor.aio_engine import AsyncIOEngine, aligned_bytes
from zerospeed.runtime.swap_tensor.optimizer_swapper import OptimizerSwapper, StagingBuffers


def test_aligned_bytes():
    assert [aligned_bytes(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_aio_round_trip_in_small_blocks(dtype, tmp_path):
    aio = AsyncIOEngine(block_size=1000, queue_depth=2, intra_op_parallelism=2)
    path = str(tmp_path / "t.swp")
    tensor = (torch.randn(3333) * 50).to(dtype)
    aio.submit_write(path, tensor, offset=8192).result()
    back = torch.empty_like(tensor)
    aio.submit_read(path, back, offset=8192).result()
    assert torch.equal(back, tensor)
    with pytest.raises(OSError, match="end of file"):
        aio.read(path, torch.empty(10_000, dtype=dtype), offset=8192)
    with pytest.raises(ValueError, match="contiguous"):
        aio.write(path, torch.zeros(4, 4).t())
    aio.shutdown()


def test_staging_buffers_are_bounded():
    pool = StagingBuffers(2, 16, pin_memory=True)
    first, second = pool.try_acquire(), pool.try_acquire()
    assert pool.try_acquire() is None and pool.nbytes == 2 * 16 * 4
    pool.release(first)
    assert pool.acquire() == first
    with pytest.raises(ValueError, match="buffer_count"):
        StagingBuffers(0, 16, pin_memory=False)
    del second


@pytest.mark.parametrize("buffer_count", [1, 3])
def test_swapper_cycles_units_through_few_buffers(buffer_count, tmp_path):
    swapper = OptimizerSwapper(str(tmp_path / "swap"), 2, 1500, buffer_count, AsyncIOEngine(block_size=4096), False)
    units = {uid: [torch.full((1500 - uid,), float(uid)), torch.full((1500 - uid,), -float(uid))] for uid in range(5)}
    for uid, tensors in units.items():
        swapper.create(uid, tensors)
    for _ in range(2):  # two "steps": read ahead (first, so one buffer must take a read-ahead back), write behind
        for uid in units:
            for ahead in range(uid + 1, len(units)):
                if not swapper.prefetch(ahead):
                    break
            master, state = swapper.swap_in(uid)
            assert swapper.resident_unit_bytes() <= swapper.staging_bytes
            master.add_(1)
            state.sub_(1)
            swapper.swap_out(uid)
    swapper.flush()
    for uid, (master, state) in units.items():
        got_master, got_state = swapper.swap_in(uid)
        assert torch.equal(got_master, master + 2) and torch.equal(got_state, state - 2)
        swapper.swap_out(uid, dirty=False)
    assert swapper.file_bytes() == 5 * 2 * aligned_bytes(1500 * 4)
    swap_dir = swapper.swap_dir
    swapper.close()
    assert not os.path.exists(swap_dir)


def test_swap_files_removed_when_the_swapper_is_collected(tmp_path):
    import gc

    swapper = OptimizerSwapper(str(tmp_path / "gc"), 1, 100, 1, AsyncIOEngine(), False)
    swapper.create(0, [torch.ones(100)])
    swap_dir = swapper.swap_dir
    assert os.listdir(swap_dir) == ["unit_000000.swp"]
    del swapper
    gc.collect()
    assert not os.path.exists(swap_dir)
