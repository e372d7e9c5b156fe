"""`RunGroups` is a frozen value (no processes): fields, mappings and the dict it was built from
cannot change it afterwards."""

import dataclasses

import pytest

from zerospeed.comm.layout import ParallelLayout
from zerospeed.comm.run_groups import AxisGroup, ExpertGroups, RunGroups

_ME = AxisGroup("group-0", (0,))
_PAIR = AxisGroup("group-01", (0, 1))


def _value(experts: dict) -> RunGroups:
    return RunGroups(ParallelLayout(2), _PAIR, _PAIR, tensor_parallel=_PAIR, experts=experts,
                     tied={"embed": _PAIR})


def test_fields_cannot_be_reassigned():
    run = _value({})
    for field in dataclasses.fields(RunGroups):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(run, field.name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.data_parallel.ranks = (1,)  # type: ignore[misc]


def test_mappings_are_read_only_and_copied():
    experts = {"ep_size_2": ExpertGroups(2, _PAIR, _ME)}
    run = _value(experts)
    experts["ep_size_1"] = ExpertGroups(1, _ME, _PAIR)   # the caller's dict changes; the value does not
    assert list(run.experts) == ["ep_size_2"]
    with pytest.raises(TypeError):
        run.experts["ep_size_1"] = ExpertGroups(1, _ME, _PAIR)  # type: ignore[index]
    with pytest.raises(TypeError):
        run.tied["other"] = _ME  # type: ignore[index]


def test_expert_lookup_and_tensor_parallel_rank():
    run = _value({"ep_size_2": ExpertGroups(2, _PAIR, _ME)})
    assert run.expert("ep_size_2").expert_data_parallel is _ME
    assert run.expert("ep_size_2").name == "ep_size_2"
    with pytest.raises(KeyError, match="ep_size_4.*ep_size_2"):
        run.expert("ep_size_4")
    assert (run.tp_size, run.tp_rank(1), run.tp_group) == (2, 1, "group-01")
    plain = RunGroups(ParallelLayout(2), _PAIR, _PAIR)
    assert (plain.tp_size, plain.tp_rank(1), plain.tp_group) == (1, 0, None)
