"""DeepSpeed's `deepspeed.runtime.pipe.topology`: the topologies (re-exported from the one topology
in `zerospeed.comm.topology`) and `PipelineParallelGrid`, the process groups of a pipeline.

The grid is the `mpu` a pipelined engine hands to everything that asks for groups: data-parallel
(same stage, other pipelines), pipe (one pipeline), model-parallel (every rank sharing this rank's
data coordinate: pipe x tensor, over which the global gradient norm is summed) and slice
(tensor-parallel). Groups are created collectively, in the same order on every rank.
"""

from __future__ import annotations

from typing import Any

from zerospeed import comm
from zerospeed.comm.groups import PIPE_MODEL_PARALLEL, create_axis_group, create_rank_groups
from zerospeed.comm.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]


def _prime_factors(n: int) -> list[int]:
    factors, divisor = [], 2
    while n > 1:
        while n % divisor == 0:
            factors.append(divisor)
            n //= divisor
        divisor += 1
    return factors


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid without a topology: prime factors of the world size alternate pipe / data."""
    num_pp = num_dp = 1
    for index, prime in enumerate(_prime_factors(world_size)):
        if index % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


class PipelineParallelGrid:
    """DeepSpeed's grid: this rank's stage and pipeline, and the groups between them."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"topology {self._topo!r} covers {self._topo.world_size()} ranks but the world size "
                             f"is {self.world_size}")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        data = create_axis_group(self._topo, "data")
        self.dp_group, self.dp_proc_group = list(data.ranks), data.group
        pipe = create_axis_group(self._topo, "pipe")
        self.pp_group, self.pp_proc_group = list(pipe.ranks), pipe.group
        self._init_model_parallel_group()
        tensor = create_axis_group(self._topo, "model")
        self.slice_group, self.slice_proc_group = list(tensor.ranks), tensor.group
        self.p2p_groups = self._p2p_pairs()

    def _init_model_parallel_group(self) -> None:
        """Ranks sharing this rank's data coordinate (DeepSpeed's `ds_model_proc_group`)."""
        rank_lists = [sorted(self._topo.get_axis_list(axis="data", idx=dp)) for dp in range(self.data_parallel_size)]
        mine = create_rank_groups(rank_lists, PIPE_MODEL_PARALLEL)
        assert mine is not None, "every rank has a data coordinate"
        self.ds_model_proc_group, self.ds_model_world_size = mine.group, len(mine.ranks)
        self.ds_model_rank = mine.ranks.index(self.global_rank)

    def _p2p_pairs(self) -> list[list[int]]:
        pairs = []
        for ranks in self._topo.get_axis_comm_lists("pipe"):
            pairs += [[rank, ranks[(i + 1) % len(ranks)]] for i, rank in enumerate(ranks)]
        return sorted(pairs)

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    # pipeline
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # data
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # model parallel = pipe x tensor
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    # slice = tensor parallel
    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
