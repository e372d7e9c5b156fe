"""Where each gradient is reduced when the model has Mixture-of-Experts layers.

[Note: expert gradient reduction]
An ordinary parameter is replicated on every data-parallel rank: its gradient is averaged over
the data-parallel group (W ranks). An expert parameter (`allreduce=False`, `group_name`
"ep_size_<n>") lives only on the ranks of its expert-data-parallel group (W / n ranks, one per
expert-parallel group), and the all-to-all's backward has already summed into it the gradients
of the tokens every rank of its expert-parallel group sent it. Summing over the expert-data-
parallel group therefore adds up all W ranks' contributions, and dividing by W — not by the
expert-data-parallel size — gives the gradient of the mean loss, as for every other parameter.
That is DeepSpeed's scaling (`_reduce_expert_gradients`: all-reduce over the expert-data-parallel
group, average with the data-parallel world size).

[Note: norm with experts]
The global gradient norm counts every distinct parameter once. Ordinary gradients are the same on
every rank (stage 0), expert gradients differ between the ranks of an expert-parallel group and
repeat across its expert-data-parallel group: so the squares of the expert gradients are summed
over the expert-parallel group (one copy of each expert), those of the rest stay local. The
gradient space declares those groups ([Note: gradient space] in grad_space.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import ExpertGroups, RunGroups
from zerospeed.moe.experts import expert_group_name as _expert_group_of
from zerospeed.runtime.overlapped_allreduce import OverlappedAllReduce
from zerospeed.runtime.precision import PrecisionSettings

__all__ = ["GroupedAllReduce", "expert_group_name", "expert_parallel_groups", "reduction_plan"]

DENSE = ""  # reduction key of ordinary parameters


def expert_group_name(param: torch.Tensor) -> str:
    """The expert group of an expert parameter, DENSE for any other."""
    return _expert_group_of(param) if getattr(param, "allreduce", True) is False else DENSE


def reduction_plan(params: Sequence[torch.Tensor]) -> dict[str, list[int]]:
    """Parameter indices by reduction key: DENSE first, then the expert groups in sorted order (the same
    order on every rank, so collectives on each group are issued in the same order everywhere)."""
    plan: dict[str, list[int]] = {}
    for index, param in enumerate(params):
        plan.setdefault(expert_group_name(param), []).append(index)
    return {key: plan[key] for key in sorted(plan)}


def _run_expert(key: str, run_groups: RunGroups | None) -> ExpertGroups:
    """The groups of expert group `key`, from the run's groups the wrapper was handed ([Note: run
    groups]); a wrapper holding expert parameters cannot work without them."""
    if run_groups is None:
        raise ValueError(f"parameters of expert group {key!r} need the run's groups (run_groups=): build the "
                         "optimizer through zerospeed.initialize, which hands them over")
    return run_groups.expert(key)


def _reduction_group(key: str, dp_group: Any, run_groups: RunGroups | None) -> Any:
    return dp_group if key == DENSE else _run_expert(key, run_groups).expert_data_parallel.group


class GroupedAllReduce:
    """Stage 0's overlapped all-reduce, one `OverlappedAllReduce` per reduction group
    ([Note: expert gradient reduction]); without experts it is exactly one over the dp group.
    Parameter `index` is the one of `params`; each reducer numbers its own members. The expert
    groups' reductions run over their expert-data-parallel groups in `run_groups`."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_numel: int, dp_group: Any,
                 settings: PrecisionSettings, grads_in_params: bool = True,
                 run_groups: RunGroups | None = None) -> None:
        dp_world_size = comm.get_world_size(dp_group)
        self.members = list(reduction_plan(params).items())
        # One group: launched buckets finish as they go; several: all at the end ([Note:
        # overlapped all-reduce] in overlapped_allreduce.py).
        self.reducers = [OverlappedAllReduce([params[i] for i in indices], bucket_numel,
                                             _reduction_group(key, dp_group, run_groups), settings,
                                             average_world_size=dp_world_size,
                                             bound_in_flight=len(self.members) == 1,
                                             grads_in_params=grads_in_params)
                         for key, indices in self.members]
        self._slot = {index: (self.reducers[r], local) for r, (_, indices) in enumerate(self.members)
                      for local, index in enumerate(indices)}

    @property
    def has_experts(self) -> bool:
        return any(key != DENSE for key, _ in self.members)

    def slot(self, index: int) -> tuple[OverlappedAllReduce, int]:
        """The reducer of parameter `index` and its number there (what a gradient hook binds)."""
        return self._slot[index]

    def view(self, index: int) -> torch.Tensor:
        """Parameter `index`'s gradient slot in its bucket ([Note: gradients as bucket views])."""
        reducer, local = self._slot[index]
        return reducer.views()[local]

    def start_window(self) -> None:
        for reducer in self.reducers:
            reducer.start_window()

    def mark_ready(self, index: int) -> None:
        reducer, local = self._slot[index]
        reducer.mark_ready(local)

    def finish(self) -> None:
        for reducer in self.reducers:
            reducer.finish()

    def grad_buffers(self) -> list[torch.Tensor]:
        return [t for reducer in self.reducers for t in reducer.grad_buffers()]

    def flat_buffers(self) -> list[torch.Tensor]:
        return [t for reducer in self.reducers for t in reducer.flat_buffers()]


def expert_parallel_groups(params: Sequence[torch.Tensor], run_groups: RunGroups | None = None) -> dict[str, Any]:
    """Expert group name -> its expert-parallel group, for every expert group among `params`: the
    ranks whose squares of that group's gradients add up to one copy of each expert ([Note: norm
    with experts]; grad_space.py declares them), from the run's groups."""
    return {key: _run_expert(key, run_groups).expert_parallel.group for key in reduction_plan(params) if key != DENSE}
