"""The parameter state machine, partition arithmetic and sub-group plan: pure, no processes."""

import pytest
import torch

from zerospeed.runtime.zero.param_state import (
    IllegalTransitionError,
    PartitionedParameter,
    ZeroParameter,
    ZeroParamState,
    ZeroParamStatus,
    attach_state,
    partition_numel,
    rank_span,
    set_status,
    set_strict,
)
from zerospeed.runtime.zero.stage3 import plan_sub_groups

NA, INFLIGHT, AV = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT, ZeroParamStatus.AVAILABLE


@pytest.mark.parametrize("numel,world_size,expected", [
    (35, 2, [(0, 18), (18, 17)]),      # ceil(35 / 2) = 18: rank 0 all real, rank 1 17 real + 1 pad
    (7, 2, [(0, 4), (4, 3)]),
    (3, 2, [(0, 2), (2, 1)]),
    (2, 4, [(0, 1), (1, 1), (2, 0), (3, 0)]),  # ranks past numel hold only padding
    (8, 1, [(0, 8)]),
])
def test_rank_spans_cover_the_parameter_once(numel, world_size, expected):
    assert [rank_span(numel, world_size, r) for r in range(world_size)] == expected
    assert partition_numel(numel, world_size) == -(-numel // world_size)
    assert sum(real for _, real in expected) == numel


def _param(numel=6, world_size=2):
    param = torch.nn.Parameter(torch.arange(float(numel)))
    state = ZeroParamState(ds_id=5, shape=param.shape, numel=numel, world_size=world_size, dp_rank=0,
                           group=None, partition=torch.zeros(partition_numel(numel, world_size)), name="w")
    return attach_state(param, state)


def test_attach_writes_the_deepspeed_attributes():
    param = _param(7, 2)
    assert isinstance(param, ZeroParameter) and isinstance(param, torch.nn.Parameter)
    assert (param.ds_id, tuple(param.ds_shape), param.ds_numel, param.ds_status) == (5, (7,), 7, AV)
    assert param.partition_numel() == 4 and param.padding_size() == 1 and param.aligned_size() == 8
    assert param.ds_tensor.ds_numel == 4 and param.ds_persist is False
    assert param.ds_summary()["status"] == "AVAILABLE"


def test_legal_cycle_and_illegal_transitions():
    param = _param()
    set_status(param, NA)
    set_status(param, INFLIGHT)
    set_status(param, AV)
    assert param.ds_status is AV
    for _start, illegal in [(AV, INFLIGHT), (AV, AV)]:
        with pytest.raises(IllegalTransitionError, match="illegal transition"):
            set_status(param, illegal)
    set_status(param, NA)
    with pytest.raises(IllegalTransitionError):
        set_status(param, AV)  # must go through INFLIGHT
    set_status(param, INFLIGHT)
    with pytest.raises(IllegalTransitionError):
        set_status(param, NA)  # an in-flight gather must be waited first


def test_engine_managed_partitioned_param_refuses_compute_but_allows_metadata():
    param = _param()
    set_strict(param)
    param.data = torch.empty(0)
    set_status(param, NA)
    assert type(param) is PartitionedParameter
    assert param.shape == (0,) and param.dtype == torch.float32 and param.numel() == 0
    assert {param: 1}[param] == 1  # hashing (dict keys) is allowed
    with pytest.raises(RuntimeError, match="'w'.*partitioned"):
        torch.nn.functional.linear(torch.ones(1, 6), param)
    set_status(param, INFLIGHT)
    param.data = torch.ones(6)
    set_status(param, AV)
    assert type(param) is ZeroParameter and float(param.detach().sum()) == 6.0


@pytest.mark.parametrize("numels,size,expected", [
    ([4, 4, 4], 8, [[0, 1], [2]]),
    ([10, 1], 5, [[0], [1]]),
    ([1, 1, 1], 100, [[0, 1, 2]]),
    ([], 10, []),
])
def test_sub_groups_close_when_they_reach_sub_group_size(numels, size, expected):
    assert plan_sub_groups(numels, size) == expected
