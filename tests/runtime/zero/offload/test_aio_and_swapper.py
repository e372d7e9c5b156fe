"""The I/O engine and the optimizer swapper on their own: byte-exact transfers, bounded buffers,
read-ahead / write-behind ordering, files removed at close."""

import errno
import os

import pytest
import torch

from zerospeed.runtime.zero.offload.aio_engine import ALIGNMENT, AsyncIOEngine, aligned_bytes, aligned_empty
from zerospeed.runtime.zero.offload.optimizer_swapper import OptimizerSwapper, StagingBuffers
from zerospeed.utils.logging import logger


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
    assert pool.try_acquire() == first and pool.try_acquire() is None
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


@pytest.mark.parametrize("num_units,buffer_count", [(6, 3), (7, 2), (3, 4)])
def test_alternating_sweeps_reuse_the_cached_units(num_units, buffer_count, tmp_path):
    """[Note: staging buffers as a write-back cache]: after the first sweep, each sweep (direction
    alternating) reads and writes exactly `units - buffer_count` units; the values stay exact."""
    aio = AsyncIOEngine(block_size=4096, intra_op_parallelism=2)
    swapper = OptimizerSwapper(str(tmp_path / "swap"), 2, 1000, buffer_count, aio, False)
    expected = {uid: [torch.full((1000,), float(uid)), torch.zeros(1000)] for uid in range(num_units)}
    for uid, tensors in expected.items():
        swapper.create(uid, tensors)
    unit_bytes = 2 * aligned_bytes(1000 * 4)
    traffic = []
    for sweep in range(5):
        order = list(range(num_units))[::(-1 if sweep % 2 else 1)]
        before = (aio.bytes_read, aio.bytes_written)
        swapper.begin_pass()
        for position, uid in enumerate(order):
            master, state = swapper.swap_in(uid)
            for ahead in order[position + 1:]:
                if not swapper.prefetch(ahead):
                    break
            assert swapper.resident_unit_bytes() <= swapper.staging_bytes
            master.add_(uid + 1)
            state.add_(master)
            expected[uid][0] += uid + 1
            expected[uid][1] += expected[uid][0]
            swapper.swap_out(uid)
        swapper.flush()
        traffic.append(((aio.bytes_read - before[0]) // unit_bytes, (aio.bytes_written - before[1]) // unit_bytes))
    evicted = max(0, num_units - buffer_count)
    assert traffic[0] == (num_units, evicted)
    assert traffic[1:] == [(evicted, evicted)] * 4
    for uid, (master, state) in expected.items():
        got = swapper.swap_in(uid)
        assert torch.equal(got[0], master) and torch.equal(got[1], state), uid
        swapper.swap_out(uid, dirty=False)
    swapper.close()


@pytest.mark.parametrize("num_units", [1, 3])
def test_growing_slots_fit_the_largest_unit_with_at_most_one_buffer_per_unit(num_units, tmp_path):
    """[Note: growing slots]: whole-partition units of sizes only known when created; a pool of 4
    buffers holding fewer units allocates one per unit (a read-ahead included), each the largest
    unit's size, and the values survive the resizes and the cycling."""
    swapper = OptimizerSwapper(str(tmp_path / "grow"), 2, 1, 4, AsyncIOEngine(block_size=4096), False, grow=True)
    sizes = [3000 * (uid + 1) + 7 for uid in range(num_units)]
    units = {uid: [torch.full((n,), float(uid + 1)), torch.zeros(n)] for uid, n in enumerate(sizes)}
    for uid, tensors in units.items():
        swapper.create(uid, tensors)
    assert swapper.slot_numel == aligned_bytes(4 * max(sizes)) // 4 and len(swapper.pool.buffers) == 1
    for _ in range(2):
        swapper.begin_pass()
        for uid in units:
            master, state = swapper.swap_in(uid)
            for ahead in range(uid + 1, num_units):
                if not swapper.prefetch(ahead):
                    break
            state.add_(master)
            swapper.swap_out(uid)
    swapper.flush()
    assert len(swapper.pool.buffers) == num_units
    assert swapper.staging_bytes == num_units * 2 * swapper.slot_numel * 4
    for uid, (master, _) in units.items():
        got_master, got_state = swapper.swap_in(uid)
        assert torch.equal(got_master, master) and torch.equal(got_state, 2 * master)
        swapper.swap_out(uid, dirty=False)
    with pytest.raises(RuntimeError, match="does not fit"):
        swapper.create(9, [torch.zeros(10 * max(sizes)), torch.zeros(10 * max(sizes))])   # units are cached
    fixed = OptimizerSwapper(str(tmp_path / "fixed"), 1, 100, 1, AsyncIOEngine(), False)
    with pytest.raises(RuntimeError, match="does not fit"):
        fixed.create(0, [torch.zeros(5000)])
    swapper.close()
    fixed.close()


def test_swap_files_removed_when_the_swapper_is_collected(tmp_path):
    import gc

    swapper = OptimizerSwapper(str(tmp_path / "gc"), 1, 100, 1, AsyncIOEngine(), False)
    swapper.create(0, [torch.ones(100)])
    swap_dir = swapper.swap_dir
    assert os.listdir(swap_dir) == ["unit_000000.swp"]
    del swapper
    gc.collect()
    assert not os.path.exists(swap_dir)


# --- O_DIRECT ------------------------------------------------------------------------------------
def _supports_direct_io(directory) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(str(directory), "probe.swp")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(aligned_empty(ALIGNMENT, torch.uint8).numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture
def direct_dir(tmp_path):
    if not _supports_direct_io(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not support O_DIRECT")
    return tmp_path


def test_aligned_empty_is_aligned():
    for numel in (1, 1000, 1 << 20):
        tensor = aligned_empty(numel, torch.float32)
        assert tensor.data_ptr() % ALIGNMENT == 0 and tensor.numel() == numel and tensor.is_contiguous()


def test_aligned_transfer_is_direct_and_byte_exact(direct_dir):
    aio = AsyncIOEngine(block_size=1000)     # rounded up to one aligned block for direct pieces
    path = str(direct_dir / "d.swp")
    tensor = aligned_empty(3 * 4096, torch.float32).copy_(torch.randn(3 * 4096))
    aio.write(path, tensor, offset=8192)
    back = aligned_empty(3 * 4096, torch.float32)
    aio.read(path, back, offset=8192)
    assert torch.equal(back, tensor)
    assert (aio.direct_bytes, aio.buffered_bytes) == (2 * tensor.nbytes, 0)


def test_unaligned_transfers_are_buffered_and_tails_split(direct_dir):
    aio = AsyncIOEngine()
    path = str(direct_dir / "u.swp")
    base = aligned_empty(4096 + 100, torch.float32).copy_(torch.randn(4096 + 100))
    aio.write(path, base.narrow(0, 1, 1024), offset=4096)          # unaligned address
    aio.write(path, base.narrow(0, 0, 1024), offset=100)           # unaligned offset
    assert (aio.direct_bytes, aio.buffered_bytes) == (0, 2 * 4096)
    aio.write(path, base, offset=65536)                             # aligned start, 400-byte tail
    assert (aio.direct_bytes, aio.buffered_bytes) == (4 * 4096, 2 * 4096 + 400)
    back = aligned_empty(4096 + 100, torch.float32)
    aio.read(path, back, offset=65536)
    assert torch.equal(back, base)
    sliced = torch.empty(1024)
    aio.read(path, sliced, offset=100)
    assert torch.equal(sliced, base.narrow(0, 0, 1024))
    with pytest.raises(OSError, match="end of file"):
        aio.read(path, aligned_empty(2 * 4096 + 1024, torch.float32), offset=65536)


def test_direct_io_off_or_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    tensor = aligned_empty(4096, torch.float32).copy_(torch.arange(4096.0))
    off = AsyncIOEngine(use_direct_io=False)
    off.write(str(tmp_path / "off.swp"), tensor)
    assert (off.direct_bytes, off.buffered_bytes) == (0, tensor.nbytes)

    real_open = os.open

    def refusing_open(path, flags, *args):  # what tmpfs did before Linux 6.6
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    warnings: list[str] = []
    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(logger, "warning", warnings.append)
    aio = AsyncIOEngine()
    for name in ("a.swp", "b.swp"):
        aio.write(str(tmp_path / name), tensor)
    back = torch.empty(4096)
    aio.read(str(tmp_path / "a.swp"), back)
    assert torch.equal(back, tensor) and aio.direct_bytes == 0 and aio.buffered_bytes == 3 * tensor.nbytes
    assert len(warnings) == 1 and "refuses O_DIRECT" in warnings[0]


def test_swapper_unit_transfers_are_direct(direct_dir):
    aio = AsyncIOEngine(block_size=4096)
    swapper = OptimizerSwapper(str(direct_dir / "swap"), 3, 1500, 2, aio, False)
    assert all(buffer.data_ptr() % ALIGNMENT == 0 for buffer in swapper.pool.buffers)
    swapper.create(0, [torch.ones(1500), torch.zeros(1500), torch.zeros(1500)])
    swapper.create_fast(1, torch.full((1000,), 2.0))
    for uid in (0, 1):
        swapper.swap_in(uid)[0].add_(1)
        swapper.swap_out(uid)
    swapper.flush()
    assert aio.buffered_bytes == 0 and aio.direct_bytes > 0
    swapper.close()


# --- fast_init -----------------------------------------------------------------------------------
def test_create_fast_reads_back_zero_states(tmp_path):
    swapper = OptimizerSwapper(str(tmp_path / "fast"), 3, 1500, 1, AsyncIOEngine(), False)
    swapper.create(0, [torch.full((1500,), 7.0)] * 3)        # leaves non-zero bytes in the buffer
    master = torch.randn(1234)
    swapper.create_fast(1, master)
    swapper.create_fast(2, master)
    swapper.create(2, [master, master, master])              # re-created: then fast again
    swapper.create_fast(2, -master)
    assert os.path.getsize(swapper.path(1)) == 3 * aligned_bytes(1234 * 4)
    for uid, expected in ((1, master), (2, -master)):
        got_master, exp_avg, exp_avg_sq = swapper.swap_in(uid)
        assert torch.equal(got_master, expected)
        assert torch.equal(exp_avg, torch.zeros(1234)) and torch.equal(exp_avg_sq, torch.zeros(1234))
        exp_avg.add_(3)
        swapper.swap_out(uid)
    swapper.flush()
    assert torch.equal(swapper.swap_in(1)[1], torch.full((1234,), 3.0))
    swapper.close()
