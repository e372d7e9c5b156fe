"""Process topology: pure rank arithmetic, no processes.

A topology names its axes (for example ``pipe``, ``data``, ``expert``, ``sequence``, ``model``)
and gives each a size. Ranks are laid out **row-major** over the axes in the order given (the
layout of DeepSpeed's ``deepspeed/runtime/pipe/topology.py::ProcessTopology``): the last axis
varies fastest, so with ``axes=["pipe", "data"]`` and ``dims=[2, 4]`` the data-parallel peers of
rank 0 are ranks 0-3 and its pipeline peer is rank 4.

Everything here is integer arithmetic over ``range(world_size)``; process groups are built from
the rank lists it returns by ``zerospeed.comm.groups``. The class keeps DeepSpeed's name and
method signatures (``ProcessTopology(axes, dims)``, ``get_rank(**coords)``, ``get_coord(rank)``,
``get_axis_comm_lists(axis)``, ...) so code written against DeepSpeed's topology runs unchanged.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

__all__ = [
    "ExpertRankLists",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "expert_rank_lists",
]


class ProcessTopology:
    """Named axes and their sizes -> coordinates -> ranks, row-major (last axis fastest)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dict(zip(axes, dims))}")
        self.axes = axes
        self.dims = dims
        # A namedtuple type per topology, as DeepSpeed: coordinates read as `coord.pipe`.
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        # Row-major strides: the stride of an axis is the product of the sizes after it.
        self._strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]

    # --- rank <-> coordinate -------------------------------------------------------------------

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() needs a coordinate on every axis "
                             f"{self.axes}, got {sorted(coord_kwargs)}; use filter_match() for slices")
        rank = 0
        for axis, dim, stride in zip(self.axes, self.dims, self._strides):
            if axis not in coord_kwargs:
                raise ValueError(f"get_rank(): unknown axis in {sorted(coord_kwargs)}; axes are {self.axes}")
            index = coord_kwargs[axis]
            if not 0 <= index < dim:
                raise ValueError(f"get_rank(): {axis}={index} is outside 0..{dim - 1}")
            rank += index * stride
        return rank

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a ``ProcessCoord`` namedtuple) of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology {dict(zip(self.axes, self.dims))}")
        coord = [(rank // stride) % dim for dim, stride in zip(self.dims, self._strides)]
        return self.ProcessCoord(*coord)  # type: ignore[arg-type]  # a namedtuple built at run time

    def _coords(self) -> Iterable[Any]:
        return (self.get_coord(rank) for rank in range(self.world_size()))

    # --- axes ----------------------------------------------------------------------------------

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 for an axis the topology does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``"model_01"``-style name of a rank's coordinate on the axes not omitted (checkpoint names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in set(omit_axes))

    # --- rank lists ----------------------------------------------------------------------------

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per group along ``axis``: ranks equal on every other axis.

        Lists come in row-major order of the other axes; [] for an axis the topology lacks (so
        hybrid code can ask for an axis that is not there). Every rank must create the groups of
        all lists in this order, so the order is part of the contract.
        """
        if axis not in self.axes:
            return []
        stride, dim = self._strides[self.axes.index(axis)], self.get_dim(axis)
        starts = [rank for rank in range(self.world_size()) if (rank // stride) % dim == 0]
        return [[start + index * stride for index in range(dim)] for start in starts]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given ``axis=index``, ascending."""
        for axis in filter_kwargs:
            if axis not in self.axes:
                raise ValueError(f"filter_match(): unknown axis {axis!r}; axes are {self.axes}")
        return [rank for rank, coord in enumerate(self._coords())
                if all(getattr(coord, axis) == index for axis, index in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            raise ValueError(f"get_axis_list(): unknown axis {axis!r}; axes are {self.axes}")
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return str({coord: rank for rank, coord in enumerate(self._coords())})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; data is the fast axis so gradient reductions stay within a node."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism; model is the fastest axis, as DeepSpeed."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class ExpertRankLists(NamedTuple):
    """The expert-parallel and expert-data-parallel rank lists of one expert-parallel size."""

    expert_parallel: list[list[int]]
    expert_data_parallel: list[list[int]]


def expert_rank_lists(world_size: int, expert_parallel_size: int, pipe_parallel_size: int = 1,
                      data_before_expert: bool = False) -> ExpertRankLists:
    """DeepSpeed's expert layout (``deepspeed/utils/groups.py::_create_expert_and_data_parallel``).

    Within each pipeline stage (a contiguous block of ``world_size / pipe_parallel_size`` ranks)
    the default puts the experts on the fast axis: expert groups are consecutive ranks and each
    expert's data-parallel replicas are strided by ``expert_parallel_size``. With
    ``data_before_expert`` the two axes swap.
    """
    if pipe_parallel_size < 1 or world_size % pipe_parallel_size:
        raise ValueError(f"world size {world_size} is not divisible by pipeline parallel size {pipe_parallel_size}")
    stage_size = world_size // pipe_parallel_size
    if expert_parallel_size < 1 or stage_size % expert_parallel_size:
        raise ValueError(f"expert parallel size {expert_parallel_size} must divide the ranks of one pipeline "
                         f"stage ({stage_size} = world size {world_size} / pipeline parallel size "
                         f"{pipe_parallel_size})")
    inner = ["expert", "expert_data"] if data_before_expert else ["expert_data", "expert"]
    sizes = {"expert": expert_parallel_size, "expert_data": stage_size // expert_parallel_size}
    topology = ProcessTopology(["pipe", *inner], [pipe_parallel_size, *(sizes[a] for a in inner)])
    return ExpertRankLists(topology.get_axis_comm_lists("expert"), topology.get_axis_comm_lists("expert_data"))
