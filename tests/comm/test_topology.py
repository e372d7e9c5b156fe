"""ProcessTopology: pure rank arithmetic, checked without processes against an independent
enumeration (itertools.product is row-major by definition) and against DeepSpeed's own class."""

import itertools

import pytest

from deepspeed_extensions import import_deepspeed

from zerospeed.comm.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
                                     expert_rank_lists)

SHAPES = [(["x"], [1]), (["x", "y"], [2, 3]), (["pipe", "data", "model"], [2, 2, 2]),
          (["pipe", "data", "expert", "model"], [3, 1, 2, 2])]


def _enumerated(axes, dims):
    """rank -> coordinate dict, by enumerating the grid in row-major order."""
    return [dict(zip(axes, coord)) for coord in itertools.product(*(range(d) for d in dims))]


@pytest.mark.parametrize("axes,dims", SHAPES)
def test_rank_and_coordinate_round_trip_row_major(axes, dims):
    topo = ProcessTopology(axes, dims)
    expected = _enumerated(axes, dims)
    assert topo.world_size() == len(expected)
    for rank, coord in enumerate(expected):
        assert topo.get_rank(**coord) == rank
        assert topo.get_coord(rank)._asdict() == coord


@pytest.mark.parametrize("axes,dims", SHAPES)
def test_axis_comm_lists_vary_one_axis_and_cover_every_rank_once(axes, dims):
    topo = ProcessTopology(axes, dims)
    coords = _enumerated(axes, dims)
    for axis in axes:
        lists = topo.get_axis_comm_lists(axis)
        assert sorted(r for ranks in lists for r in ranks) == list(range(topo.world_size()))
        for ranks in lists:
            assert [coords[r][axis] for r in ranks] == list(range(topo.get_dim(axis)))
            others = {tuple(v for a, v in coords[r].items() if a != axis) for r in ranks}
            assert len(others) == 1
        assert lists == sorted(lists)  # row-major order of the other axes: ascending first ranks


def test_documented_examples():
    topo = ProcessTopology(["pipe", "data", "model"], [2, 2, 2])
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_axis_list("data", 0) == [0, 1, 4, 5]
    assert topo.get_rank_repr(rank=3) == "model_01"
    assert topo.get_rank_repr(rank=7, omit_axes=["model"], inner_sep="=", outer_sep="/") == "pipe=01/data=01"
    assert topo.get_dim("expert") == 0 and topo.get_axis_comm_lists("expert") == []
    assert PipeDataParallelTopology(num_pp=2, num_dp=4).get_axis_comm_lists("data") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mixed = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert (mixed.get_axis_names(), mixed.get_dim("data"), mixed.get_dim("model")) == (["pipe", "data", "model"], 3, 2)
    assert mixed.get_coord(7) == mixed.ProcessCoord(pipe=1, data=0, model=1)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="2 axes"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match="unique"):
        ProcessTopology(["a", "a"], [2, 2])
    topo = ProcessTopology(["a", "b"], [2, 2])
    with pytest.raises(ValueError, match="slices"):
        topo.get_rank(a=0)
    with pytest.raises(ValueError, match="b=2"):
        topo.get_rank(a=0, b=2)
    with pytest.raises(ValueError, match="rank 4"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="'c'"):
        topo.filter_match(c=0)


@pytest.mark.parametrize("world,ep,pp,data_first,expected_ep,expected_edp", [
    # DeepSpeed's docstring example (world 16, ep 2), cut to 8 ranks
    (8, 2, 1, False, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (8, 2, 1, True, [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 2, 2, False, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (4, 4, 1, False, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
])
def test_expert_rank_lists(world, ep, pp, data_first, expected_ep, expected_edp):
    lists = expert_rank_lists(world, ep, pp, data_first)
    assert (lists.expert_parallel, lists.expert_data_parallel) == (expected_ep, expected_edp)


def test_expert_rank_lists_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="expert parallel size 3"):
        expert_rank_lists(8, 3)


@pytest.mark.parametrize("axes,dims", SHAPES)
def test_same_answers_as_deepspeed(axes, dims, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_topology = import_deepspeed("deepspeed.runtime.pipe.topology")
    ours, theirs = ProcessTopology(axes, dims), ds_topology.ProcessTopology(list(axes), list(dims))
    for rank in range(ours.world_size()):
        assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
        assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)
    for axis in [*axes, "absent"]:
        assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
        assert ours.get_dim(axis) == theirs.get_dim(axis)
    for axis, dim in zip(axes, dims):
        for index in range(dim):
            assert ours.get_axis_list(axis, index) == theirs.get_axis_list(axis, index)
            assert ours.filter_match(**{axis: index}) == theirs.filter_match(**{axis: index})
