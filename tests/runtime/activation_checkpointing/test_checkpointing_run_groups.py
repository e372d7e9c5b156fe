"""Activation checkpointing reads the tensor-parallel rank and group from the run's groups when
`configure` got no mpu, and from the mpu when it got one (DeepSpeed's public API: the mpu wins)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.layout import ParallelLayout
from zerospeed.comm.run_groups import AxisGroup, RunGroups

SEED, OFFSET = 100, 2718   # DeepSpeed's tracker seed: seed + 2718 + tp rank


class _RankZeroMpu:
    """A user's mpu that puts every rank at tensor-parallel rank 0 of a group of one."""

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return None


def _tp_view(with_tp: bool, mpu_given: bool) -> tuple[bool, int, int]:
    from zerospeed.runtime.activation_checkpointing import checkpointing
    from zerospeed.runtime.activation_checkpointing.rng import get_cuda_rng_tracker

    world = AxisGroup(comm.get_world_group(), (0, 1))
    run = RunGroups(ParallelLayout(2, tensor=2 if with_tp else 1), world, world,
                    tensor_parallel=world if with_tp else None)
    patch = pytest.MonkeyPatch()
    try:
        # the worker may keep an earlier test's mpu and run: this test sets both and puts them back
        patch.setattr(checkpointing, "_mpu", None)
        patch.setattr(groups, "_run", run)
        checkpointing.configure(_RankZeroMpu() if mpu_given else None, partition_activations=True)
        checkpointing.model_parallel_cuda_manual_seed(SEED)
        state = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        tp_rank = next(r for r in range(4) if torch.equal(
            state, torch.Generator().manual_seed(SEED + OFFSET + r).get_state()))
        partition = checkpointing._partition
        return partition.group is (world.group if with_tp and not mpu_given else None), partition.rank, tp_rank
    finally:
        patch.undo()
        checkpointing.configure(None)   # the settings and partition group from the restored mpu


@pytest.mark.parametrize("with_tp, mpu_given", [(True, False), (False, False), (True, True)])
def test_tensor_parallel_rank_from_the_run_groups_unless_an_mpu_is_given(with_tp, mpu_given):
    results = run_on_ranks(_tp_view, 2, with_tp, mpu_given)
    from_run = with_tp and not mpu_given
    assert results == [(True, rank if from_run else 0, rank if from_run else 0) for rank in range(2)]
