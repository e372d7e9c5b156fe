"""`GradSpace`: one description of the step's gradient vector, for the overflow flag and the norm.

[Note: gradient space]
The model's gradient vector is spread over ranks in up to four ways, and the global norm must count
each element exactly once while every rank that steps together agrees on the overflow flag:

- ZeRO 1-3 (`partitioned`): each data-parallel rank holds a disjoint partition, so squares are
  summed over the dp group. Stage 0: every rank holds the whole averaged vector, no sum.
- Expert parameters at stage 0 (`expert_groups`): replicated over their expert-data-parallel
  group but distinct between the ranks of their expert-parallel group, so an expert part's squares
  are summed over its ep group ([Note: expert gradient reduction] in expert_gradients.py). At
  ZeRO 1-3 the dp sum already counts each expert once (each rank holds a disjoint partition of its
  ep rank's experts), so no expert part is declared.
- AutoTP (`tp_group`): split parameters' pieces differ between tp ranks and are summed over the
  tp group; replicated ones are equal there and counted once. Older DeepSpeed counted only tp rank
  0's pieces (off by about sqrt(tp), fixed in DeepSpeed PR#5411).
- Pipeline (`pipeline`): each stage holds its own layers; a tied weight lives on several stages,
  so the copies after the first are subtracted (dp-averaged) before the sum over the pipe group.

A wrapper hands its gradients as pieces, each tagged with its part (`part_of(param)`); the space
sums each part's squares locally (float64, [Note: chunked float64 norm] in grad_utils.py), over the
dp group when partitioned (all parts in one collective), then over the part's own group (ep or
tp), subtracts tied duplicates, sums over the pipe group, and adds the parts in order. That order
is the one the four former norm helpers used, so the fp32 numbers are unchanged.

The overflow flag is OR-ed over every group whose ranks must skip the same steps: the dp group
when gradients are partitioned or differ (experts), the pipeline's model-parallel group (every
stage keeps the same loss scale) and the tp group (a split gradient can overflow on one tp rank).

Clipping has one formula (`grad_utils.unscale_and_clip_factor`), applied by the wrapper's update.
The factory (`optimizer_factory.build_grad_space`) builds the space once from the run's layout and
groups and hands it to the wrapper's constructor; nothing changes it afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.expert_gradients import expert_group_name, expert_parallel_groups
from zerospeed.runtime.grad_utils import any_non_finite, sum_of_squares

__all__ = ["DENSE", "GradSpace", "PartKey", "Piece", "PipelineStages"]

PartKey = tuple[str, bool]   # (expert group name, "" for dense; whether the elements are tp-split)
Piece = tuple[torch.Tensor, PartKey]
DENSE: PartKey = ("", False)


@dataclasses.dataclass(frozen=True)
class PipelineStages:
    """What the pipeline adds: the stages' sum, the flag's group, the tied copies to count once."""

    pipe_group: Any
    model_parallel_group: Any
    tied_duplicate_squares: Callable[[], float]


@dataclasses.dataclass(frozen=True)
class GradSpace:
    """[Note: gradient space]. `dp_group`: the data-parallel group of the wrapper's reduction."""

    dp_group: Any = None
    partitioned: bool = False
    expert_groups: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tp_group: Any = None
    pipeline: PipelineStages | None = None

    @classmethod
    def data_parallel(cls, dp_group: Any, partitioned: bool, params: Sequence[torch.Tensor] = (),
                      run_groups: RunGroups | None = None) -> GradSpace:
        """Data (and expert) parallelism alone. At stage 0 the expert parts' groups come from
        `run_groups` (needed when `params` hold expert parameters); ZeRO 1-3 declare no expert part."""
        return cls(dp_group, partitioned, {} if partitioned else expert_parallel_groups(params, run_groups))

    def part_of(self, param: torch.Tensor) -> PartKey:
        """The part a parameter's gradient elements belong to."""
        expert = expert_group_name(param) if self.expert_groups else ""
        return expert, self.tp_group is not None and bool(getattr(param, "tensor_model_parallel", False))

    @property
    def splits_tensor_parallel(self) -> bool:
        """Whether a wrapper must hand tp-split and replicated elements as separate pieces."""
        return self.tp_group is not None

    def overflow_groups(self) -> tuple[Any, ...]:
        groups: list[Any] = []
        if self.partitioned or self.expert_groups:
            groups.append(self.dp_group)
        if self.pipeline is not None:
            groups.append(self.pipeline.model_parallel_group)
        if self.tp_group is not None:
            groups.append(self.tp_group)
        return tuple(groups)

    def overflow(self, tensors: Sequence[torch.Tensor], comm_device: torch.device | None = None) -> bool:
        """Whether any element of the step's gradients, on any rank that steps with this one, is inf or nan."""
        return any_non_finite(tensors, self.overflow_groups(), comm_device=comm_device)

    def scaled_norm(self, pieces: Sequence[Piece], comm_device: torch.device | None = None) -> float:
        """The L2 norm of the whole gradient vector (in the gradients' scale), the same on every rank."""
        keys = sorted({key for _, key in pieces} or {DENSE}, key=lambda k: (k[0], not k[1]))
        squares = [sum_of_squares([t for t, key in pieces if key == part]).reshape(1) for part in keys]
        device = comm_device or squares[0].device
        vector = torch.cat([s.to(device) for s in squares])
        if self.partitioned and comm.is_initialized():
            comm.all_reduce(vector, op=comm.ReduceOp.SUM, group=self.dp_group)
        values = [self._spread(vector[i:i + 1], key) for i, key in enumerate(keys)]
        if self.pipeline is not None:
            values = self._over_stages(values)
        total = 0.0
        for value in values:
            total += float(value.item())
        return math.sqrt(max(total, 0.0)) if math.isfinite(total) else math.inf

    def _spread(self, squares: torch.Tensor, key: PartKey) -> torch.Tensor:
        """A part's squares summed over the ranks holding its other elements (ep or tp peers)."""
        expert, split = key
        group = self.tp_group if split else self.expert_groups.get(expert) if expert else None
        if group is None or comm.get_world_size(group) <= 1:
            return squares
        squares = squares.clone()
        comm.all_reduce(squares, op=comm.ReduceOp.SUM, group=group)
        return squares

    def _over_stages(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tied copies after the first subtracted (they are dense replicated elements), then every
        stage's squares summed: one collective over the pipe group."""
        assert self.pipeline is not None
        vector = torch.cat(values)
        vector[:1] -= self.pipeline.tied_duplicate_squares()
        comm.all_reduce(vector, op=comm.ReduceOp.SUM, group=self.pipeline.pipe_group)
        return list(vector.split(1))
