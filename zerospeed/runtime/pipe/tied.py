"""[Note: tied weights] Tied weights across pipeline stages: groups, initial sync, gradient sum.

A `TiedLayerSpec` key used on several stages gives each of them a copy of the module. For every
data-parallel (and tensor-parallel) coordinate, the ranks holding a key form a tie group
(DeepSpeed's `_index_tied_modules`, created in sorted key order on every rank).

The copies must receive the same gradient, the sum of every copy's contribution. ZeRO wrappers
keep a parameter's gradient in their own buffers (`.grad` a view of a flat buffer at stages 0-1,
or taken out of `.grad` as soon as backward produces it), reduced by them, so the sum cannot be
formed in `.grad` as DeepSpeed does. Instead:

* while the micro-batches run, a tensor hook keeps this copy's own contribution (fp32);
* at ReduceTiedGrads the contributions are summed over the tie group, and each copy receives the
  *other* copies' part through `param.backward(others)`: to the optimizer wrapper it is one more
  gradient contribution, accumulated and reduced like any other, whatever the ZeRO stage.

The global gradient norm counts a tied weight once: `duplicate_sq_norm()` is what the copies
after the first add, to be subtracted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.runtime.pipe.layer_spec import TiedLayerSpec

__all__ = ["TiedGroups"]


def _getattr_path(module: torch.nn.Module, path: str) -> torch.Tensor:
    value: Any = module
    for name in path.split("."):
        value = getattr(value, name)
    return value


@dataclasses.dataclass
class _Tie:
    key: str
    ranks: list[int]
    group: Any
    module: torch.nn.Module
    weight_attr: list[str]

    def weights(self) -> list[torch.Tensor]:
        return [_getattr_path(self.module, attr) for attr in self.weight_attr]

    @property
    def is_first_copy(self) -> bool:
        return comm.get_rank() == self.ranks[0]


class TiedGroups:
    def __init__(self, ties: list[_Tie]) -> None:
        self.ties = ties
        self._local: dict[int, torch.Tensor] = {}
        self._totals: dict[int, torch.Tensor] = {}
        self._tracking = False
        self._handles: list[Any] = []

    @classmethod
    def build(cls, module: Any) -> TiedGroups:
        """Create every tie group on every rank (collective), keeping the ones this rank is in."""
        grid, topo = module.mpu(), module.topology()
        if topo.get_dim("pipe") == 1:
            return cls([])
        specs = module._layer_specs
        keys = sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)})
        ties = []
        for key in keys:
            stages = sorted({module.stage_owner(i) for i, s in enumerate(specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            rank_lists = []
            for dp in range(grid.get_data_parallel_world_size()):
                for mp in range(grid.get_slice_parallel_world_size()):
                    coords = {"data": dp, "model": mp} if "model" in topo.get_axis_names() else {"data": dp}
                    rank_lists.append([grid.stage_to_global(stage_id=s, **coords) for s in stages])
            mine = groups.create_rank_groups(rank_lists, f"pipe_tied_{key}")
            if mine is not None:
                ties.append(_Tie(key, list(mine.ranks), mine.group, module.tied_modules[key],
                                 module.tied_weight_attrs[key]))
        return cls(ties)

    def items(self) -> list[tuple[str, _Tie]]:
        return [(tie.key, tie) for tie in self.ties]

    def __len__(self) -> int:
        return len(self.ties)

    def _shared(self) -> list[tuple[_Tie, torch.Tensor]]:
        return [(tie, w) for tie in self.ties if len(tie.ranks) > 1 for w in tie.weights()]

    @torch.no_grad()
    def synchronize_weights(self) -> None:
        for tie, weight in self._shared():
            comm.broadcast(weight.data, src=min(tie.ranks), group=tie.group)

    def allreduce_grads(self) -> None:
        """DeepSpeed's `allreduce_tied_weight_gradients`: sum `.grad` in place over each tie group."""
        for tie, weight in self._shared():
            if weight.grad is not None:
                comm.all_reduce(weight.grad, group=tie.group)

    def weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(weight, tie.group) for tie in self.ties for weight in tie.weights()]

    # --- the engine's protocol (see the module docstring) ---------------------------------------
    def start_tracking(self) -> None:
        if self._handles:
            return
        for _, weight in self._shared():
            self._handles.append(weight.register_hook(self._recorder(weight)))
        self._tracking = True

    def _recorder(self, weight: torch.Tensor) -> Any:
        def record(grad: torch.Tensor) -> None:
            if self._tracking:
                key = id(weight)
                held = self._local.get(key)
                self._local[key] = grad.detach().float().clone() if held is None else held.add_(grad.detach())

        return record

    def reduce_and_inject(self) -> None:
        """Sum the copies' contributions over each tie group; give each copy the others' part."""
        self._tracking = False
        self._totals = {}
        for tie, weight in self._shared():
            local = self._local.get(id(weight), torch.zeros(weight.shape, dtype=torch.float32, device=weight.device))
            total = local.clone()
            comm.all_reduce(total, group=tie.group)
            self._totals[id(weight)] = total
            if weight.requires_grad:
                weight.backward((total - local).to(weight.dtype))
        self._local = {}
        self._tracking = True

    def duplicate_sq_norm(self, dp_group: Any) -> float:
        """Squared norm the copies after the first add to the global norm (dp-averaged gradients)."""
        total = 0.0
        dp_size = comm.get_world_size(dp_group)
        for tie, weight in self._shared():
            if tie.is_first_copy or id(weight) not in self._totals:
                continue
            averaged = self._totals[id(weight)].double()
            if dp_size > 1:
                comm.all_reduce(averaged, group=dp_group)
                averaged = averaged / dp_size
            total += float(averaged.square().sum())
        return total
