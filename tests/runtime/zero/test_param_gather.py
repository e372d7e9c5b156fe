"""DeepSpeed's per-parameter `param.all_gather()` / `param.partition()`: they call the gather
primitives their state was handed at conversion (param_gather.py), so the parameter class imports
no gather code. Without processes against a recording stand-in; on 2 gloo ranks against the
parameter before it was partitioned."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from zerospeed.runtime.zero.param_state import ZeroParamState, ZeroParamStatus, attach_state, partition_numel


class _Recording:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.waited = 0

    def gather(self, params):
        self.calls.append(("gather", [id(p) for p in params]))
        return self

    def wait(self) -> None:
        self.waited += 1

    def release(self, params, has_been_updated):
        self.calls.append(("release", [id(p) for p in params], has_been_updated))


def _param(collectives=None):
    param = torch.nn.Parameter(torch.arange(6.0))
    state = ZeroParamState(ds_id=1, shape=param.shape, numel=6, world_size=2, dp_rank=0, group=None,
                           partition=torch.zeros(partition_numel(6, 2)), name="w", collectives=collectives)
    return attach_state(param, state)


def test_methods_call_the_states_collectives():
    recording = _Recording()
    param, other = _param(recording), _param(recording)
    assert param.all_gather() is recording and recording.waited == 1
    assert param.all_gather([param, other], async_op=True) is recording and recording.waited == 1
    param.partition(has_been_updated=True)
    param.partition([other])
    assert recording.calls == [("gather", [id(param)]), ("gather", [id(param), id(other)]),
                               ("release", [id(param)], True), ("release", [id(other)], False)]


def test_a_state_without_collectives_is_refused_by_name():
    with pytest.raises(RuntimeError, match="'w' .* has no gather primitives"):
        _param().all_gather()


def _gather_and_release() -> dict:
    from zerospeed.runtime.zero.param_conversion import convert_to_zero_param
    from zerospeed.runtime.zero.param_gather import PARAM_COLLECTIVES

    torch.manual_seed(0)
    full = torch.randn(5, 3)
    param = convert_to_zero_param(torch.nn.Parameter(full.clone()), name="w")
    handed = param.zs_state.collectives is PARAM_COLLECTIVES
    empty = (param.ds_status, tuple(param.data.shape))
    param.all_gather()
    gathered = (param.ds_status, torch.equal(param.data, full))
    param.data.add_(1.0)
    param.partition(has_been_updated=True)
    released = (param.ds_status, tuple(param.data.shape))
    param.all_gather()
    return {"handed": handed, "empty": empty, "gathered": gathered, "released": released,
            "updated": torch.equal(param.data, full + 1.0)}


def test_gather_and_release_on_two_ranks():
    NA, AV = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE
    for result in run_on_ranks(_gather_and_release, 2):
        assert result["handed"]
        assert result["empty"] == (NA, (0,)) and result["released"] == (NA, (0,))
        assert result["gathered"] == (AV, True) and result["updated"]
