"""``comm.destroy_process_group`` on gloo waits for every rank first ([Note: gloo exit abort])."""

import torch.distributed as dist

from distributed import run_on_ranks
from zerospeed import comm


def _destroy_a_group():
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    comm.configure(enabled=True, prof_all=True)
    comm.comms_logger.reset()
    try:
        comm.destroy_process_group(group)
        ops = [r.op for r in comm.comms_logger.records]
    finally:
        comm.configure(enabled=False)
    world_still_works = comm.get_world_size() == 2 and comm.is_initialized()
    return ops, world_still_works


def test_destroying_a_gloo_group_runs_a_barrier_over_it_first():
    assert run_on_ranks(_destroy_a_group, 2) == [(["barrier"], True)] * 2


def _destroy_a_group_of_rank_zero():
    group = dist.new_group(ranks=[0], backend="gloo")  # rank 1 gets the non-member placeholder
    comm.destroy_process_group(group)
    return comm.is_initialized()


def test_a_rank_outside_the_group_destroys_it_quietly_as_torch_does():
    assert run_on_ranks(_destroy_a_group_of_rank_zero, 2) == [True, True]


def _destroy_while_failing():
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    comm.configure(enabled=True, prof_all=True)
    comm.comms_logger.reset()
    try:
        try:
            raise RuntimeError("a rank's training failed")
        finally:
            comm.destroy_process_group(group)  # the clean-up of a failing script
    except RuntimeError:
        pass
    finally:
        comm.configure(enabled=False)
    return [r.op for r in comm.comms_logger.records]


def test_no_barrier_while_an_exception_propagates_so_a_failing_rank_still_exits():
    assert run_on_ranks(_destroy_while_failing, 2) == [[], []]
