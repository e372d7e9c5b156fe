"""Process groups built from a topology, on real gloo ranks: each group holds the ranks the
topology says, and a collective over it reduces over exactly those ranks."""

import torch

from distributed import run_on_ranks
from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.topology import ProcessTopology
from zerospeed.utils import groups as ds_groups


def _members(group):
    """The global ranks of `group`, found by communicating over it (not by asking the registry)."""
    flags = torch.zeros(comm.get_world_size())
    flags[comm.get_rank()] = 1.0
    comm.all_reduce(flags, group=group)
    return [r for r in range(len(flags)) if flags[r] == 1.0]


def _data_model_sequence(axes, dims):
    groups.reset()
    topology = ProcessTopology(axes, dims)
    groups.initialize(topology)
    result = {"data": _members(ds_groups.get_data_parallel_group()),
              "data_size": ds_groups.get_data_parallel_world_size(),
              "data_rank": ds_groups.get_data_parallel_rank()}
    if "model" in axes:
        result["model"] = _members(ds_groups.get_model_parallel_group())
    if "sequence" in axes:
        result["sequence"] = _members(ds_groups._get_sequence_parallel_group())
        result["sequence_data"] = _members(ds_groups._get_sequence_data_parallel_group())
        result["sp_size"] = ds_groups._get_sequence_parallel_world_size()
    groups.reset()
    return result


def _world_check():
    groups.reset()
    group = groups.initialize_data_parallel().group
    same = group is comm.get_world_group()
    size = ds_groups._get_data_parallel_world_size()
    groups.reset()
    return same, size


def test_data_parallel_over_the_world_is_the_world_group():
    assert run_on_ranks(_world_check, 2) == [(True, 2), (True, 2)]


def test_data_and_model_groups_on_four_ranks():
    results = run_on_ranks(_data_model_sequence, 4, ["data", "model"], [2, 2])
    for rank, result in enumerate(results):
        assert result["model"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert result["data"] == [rank % 2, rank % 2 + 2]
        assert (result["data_size"], result["data_rank"]) == (2, rank // 2)


def test_sequence_and_sequence_data_groups_on_four_ranks():
    results = run_on_ranks(_data_model_sequence, 4, ["data", "sequence"], [2, 2])
    for rank, result in enumerate(results):
        assert result["sequence"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert result["data"] == [rank % 2, rank % 2 + 2]
        assert result["sequence_data"] == [0, 1, 2, 3]
        assert result["sp_size"] == 2


def _experts(ep_size, data_first):
    groups.reset()
    ds_groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=data_first)
    ds_groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=data_first)  # no-op
    name = f"ep_size_{ep_size}"
    result = (_members(ds_groups._get_expert_parallel_group(name)),
              _members(ds_groups._get_expert_data_parallel_group(name)),
              ds_groups._get_expert_parallel_group_ranks(name),
              ds_groups._get_expert_parallel_world_size(name), ds_groups._get_expert_data_parallel_rank(name),
              ds_groups._get_max_expert_size_name())
    groups.reset()
    return result


def test_expert_groups_on_four_ranks():
    for rank, (ep, edp, ep_ranks, ep_size, edp_rank, max_name) in enumerate(run_on_ranks(_experts, 4, 2, False)):
        assert ep == ep_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert edp == [rank % 2, rank % 2 + 2]
        assert (ep_size, edp_rank, max_name) == (2, rank // 2, "ep_size_2")
    for rank, (ep, edp, *_rest) in enumerate(run_on_ranks(_experts, 4, 2, True)):
        assert ep == [rank % 2, rank % 2 + 2]
        assert edp == [rank - rank % 2, rank - rank % 2 + 1]


def test_expert_groups_on_two_ranks():
    for rank, (ep, edp, *_rest) in enumerate(run_on_ranks(_experts, 2, 2, False)):
        assert (ep, edp) == ([0, 1], [rank])


def _missing():
    groups.reset()
    errors = []
    for call in (ds_groups.get_data_parallel_group, lambda: ds_groups._get_expert_parallel_group("ep_size_2")):
        try:
            call()
        except RuntimeError as error:
            errors.append(str(error))
    try:
        ds_groups._get_sequence_parallel_group()
    except KeyError as error:
        errors.append(str(error))
    return errors, ds_groups._get_sequence_parallel_world_size(), ds_groups.get_model_parallel_world_size()


def test_uninitialized_groups_say_so():
    errors, sp_size, mp_size = run_on_ranks(_missing, 2)[0]
    assert "'data_parallel' is not initialized" in errors[0]
    assert "_create_expert_and_data_parallel" in errors[1]
    assert "sequence parallel" in errors[2]
    assert (sp_size, mp_size) == (1, 1)
