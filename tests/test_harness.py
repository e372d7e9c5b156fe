"""The harness itself: real ranks, results in rank order, a rank's traceback, pool reuse."""

import os

import pytest
import torch
import torch.distributed as dist

from distributed import RankError, run_on_ranks


def _sum_of_ranks():
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), dist.get_world_size(), tensor.item(), os.getpid()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return "fine"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_run_a_real_collective(world_size):
    results = run_on_ranks(_sum_of_ranks, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert [r[:3] for r in results] == [(rank, world_size, expected_sum) for rank in range(world_size)]
    assert len({r[3] for r in results}) == world_size  # one real process per rank


def test_pool_is_reused():
    first = {r[3] for r in run_on_ranks(_sum_of_ranks, 2)}
    second = {r[3] for r in run_on_ranks(_sum_of_ranks, 2)}
    assert first == second


def test_rank_traceback_is_reraised_with_its_rank():
    with pytest.raises(RankError, match=r"rank 1 of 2 raised(.|\n)*boom from rank one"):
        run_on_ranks(_raise_on_rank_one, 2)
    assert [r[0] for r in run_on_ranks(_sum_of_ranks, 2)] == [0, 1]  # a fresh pool after the error


def _return_a_lock():
    import threading

    return threading.Lock()   # cannot be pickled back to the parent


def _die_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    import time

    time.sleep(45)   # rank 0 is busy (no collective to notice the death): only the parent can


def test_an_unpicklable_result_is_the_ranks_error_not_a_timeout():
    with pytest.raises(RankError, match=r"cannot be sent back \(lock\)"):
        run_on_ranks(_return_a_lock, 2, timeout_s=60)


def test_a_rank_that_dies_fails_the_call_before_the_timeout():
    import time

    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died with exit code 3"):
        run_on_ranks(_die_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - start < 30   # not the 60 s deadline
