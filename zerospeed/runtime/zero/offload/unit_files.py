"""`UnitFiles`: where `OffloadStates`' swap units live under `offload_optimizer.device: nvme`.

[Note: unit files]
A unit's file holds its fp32 master, then the state tensors its optimizer names for the unit's
param group (`swap_state_names(group)`: Adam's `exp_avg` and `exp_avg_sq`, Muon's
`momentum_buffer`), each of the unit's numel. `initial_scalar_state(group)` is the rest of the
state of a unit never stepped (Adam's `step` 0), set beside the zero tensors a new file reads back
as. An optimizer without these two methods cannot be swapped; the CPU ops (ops/cpu_optimizer.py)
and `MuonWithAuxAdam` have them. DeepSpeed's `save_muon_momentum_buffer_in_memory` leaves the
momentum out of the files: it stays in the optimizer's state in host memory, created by the first
step as without NVMe (the same numbers either way).

Units come in two kinds, each with its own `OptimizerSwapper`, so neither sizes the other's
staging buffers:
- elementwise units (at most `unit_numel` elements): `buffer_count` buffers of that size,
  allocated up front, files in `<swap root>/optimizer/`;
- whole-partition units ([Note: whole-partition units] in offload_states.py: Muon's groups): slots
  that grow to the largest such unit and buffers allocated on first use ([Note: growing slots] in
  optimizer_swapper.py), at most `buffer_count` and never more than there are such units; files
  in `<swap root>/optimizer_whole_partitions/`. At stages 1 and 2 a Muon param group's partition
  is one unit, so its master and momentum take one buffer that size for the whole run (the host
  memory `cpu` offload spends on that group); at stage 3 a Muon sub-group is one unit as any
  sub-group is, and host memory stays bounded by `buffer_count` sub-groups.
Both swappers share one `AsyncIOEngine` (the `aio` block). A file is named by its unit's id,
unique over both kinds.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine
from zerospeed.runtime.zero.offload.optimizer_swapper import OptimizerSwapper

__all__ = ["UnitFiles", "UnitLayout", "check_swappable", "unit_layout"]


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """How the units of one base-optimizer param group are cut and filed."""

    whole: bool                               # one unit per partition ([Note: whole-partition units])
    swapped: tuple[str, ...]                  # the state tensors in its file, after the master
    initial_scalars: dict[str, Any] = dataclasses.field(default_factory=dict)
    in_memory: tuple[str, ...] = ()           # the state tensors kept out of the files

    def fresh_scalars(self) -> dict[str, Any]:
        """A new copy of `initial_scalars` for one unit (a tensor `step` is incremented in place)."""
        return {key: value.clone() if torch.is_tensor(value) else value for key, value in self.initial_scalars.items()}


def check_swappable(optimizer: torch.optim.Optimizer) -> None:
    if not all(hasattr(optimizer, name) for name in ("swap_state_names", "initial_scalar_state")):
        raise TypeError("offload_optimizer.device 'nvme' needs a zerospeed CPU optimizer (the optimizer block's "
                        "Adam/AdamW/Adagrad/Lion, or DeepSpeedCPUAdam) or the Muon optimizer; got "
                        f"{type(optimizer).__name__}")


def unit_layout(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                kept_in_memory: tuple[str, ...] = ()) -> UnitLayout:
    """The layout of `group`'s units; `kept_in_memory`: state names left out of the files."""
    whole = bool(getattr(optimizer, "needs_whole_partitions", lambda _: False)(group))
    names = getattr(optimizer, "swap_state_names", None)
    scalars = getattr(optimizer, "initial_scalar_state", None)
    all_names = tuple(names(group)) if names is not None else ()
    swapped = tuple(name for name in all_names if name not in kept_in_memory)
    in_memory = tuple(name for name in all_names if name in kept_in_memory)
    return UnitLayout(whole, swapped, dict(scalars(group)) if scalars is not None else {}, in_memory)


class UnitFiles:
    def __init__(self, offload_config: Any, aio_config: Any, swap_root: str, unit_numel: int) -> None:
        self.aio = AsyncIOEngine(aio_config.block_size, aio_config.queue_depth, aio_config.intra_op_parallelism)
        self._config = offload_config
        self._root = swap_root
        self._unit_numel = unit_numel
        self._swappers: dict[bool, OptimizerSwapper] = {}     # whole-partition units or not
        self._of_unit: dict[int, OptimizerSwapper] = {}

    @property
    def elementwise(self) -> OptimizerSwapper | None:
        """The swapper of the elementwise units (None before one is created)."""
        return self._swappers.get(False)

    @property
    def whole(self) -> OptimizerSwapper | None:
        """The swapper of the whole-partition units (None before one is created)."""
        return self._swappers.get(True)

    @property
    def swappers(self) -> list[OptimizerSwapper]:
        return list(self._swappers.values())

    def _swapper(self, layout: UnitLayout) -> OptimizerSwapper:
        num_tensors = 1 + len(layout.swapped)
        swapper = self._swappers.get(layout.whole)
        if swapper is None:
            name = "optimizer_whole_partitions" if layout.whole else "optimizer"
            swapper = OptimizerSwapper(os.path.join(self._root, name), num_tensors,
                                       1 if layout.whole else self._unit_numel, self._config.buffer_count,
                                       self.aio, self._config.pin_memory, grow=layout.whole)
            self._swappers[layout.whole] = swapper
        elif swapper.num_tensors != num_tensors:
            raise RuntimeError(f"units of {num_tensors} and {swapper.num_tensors} tensors in one swap directory")
        return swapper

    def create(self, uid: int, layout: UnitLayout, master: torch.Tensor, fast: bool) -> None:
        """A new unit's file: its master and zero states (`fast`: the states left a file hole)."""
        swapper = self._swapper(layout)
        self._of_unit[uid] = swapper
        if fast:
            swapper.create_fast(uid, master)
        else:
            zeros = torch.zeros_like(master)
            swapper.create(uid, [master] + [zeros] * len(layout.swapped))

    def of(self, uid: int) -> OptimizerSwapper:
        return self._of_unit[uid]

    def begin_pass(self) -> None:
        for swapper in self._swappers.values():
            swapper.begin_pass()

    def flush(self) -> None:
        for swapper in self._swappers.values():
            swapper.flush()

    @property
    def staging_bytes(self) -> int:
        return sum(swapper.staging_bytes for swapper in self._swappers.values())

    def resident_unit_bytes(self) -> int:
        return sum(swapper.resident_unit_bytes() for swapper in self._swappers.values())

    def close(self) -> None:
        """Wait for I/O and remove the files; the shared aio engine is shut down by the first swapper."""
        for swapper in self._swappers.values():
            swapper.close()
