"""`OffloadStates`: ZeRO-Offload's host side, the fp32 master partitions and optimizer states in
host memory (`offload_optimizer.device: cpu`) or on NVMe (`nvme`), stepped by a CPU optimizer.

A ZeRO wrapper registers each low-precision partition it owns (`register`, one per stage-1/2
param group or stage-3 sub-group) and, at the step, hands over the partitioned gradients and
the unscale/clip multiplier (`step`). Everything between is here:

- [Note: swap units] each partition is cut into units of at most `unit_numel` elements
  (`swap_unit_numel` in host_memory_check.py: `zero_optimization.sub_group_size` at stages 1
  and 2; at stage 3 the largest sub-group, at most twice `sub_group_size`, so a sub-group is one
  unit, not a full unit plus a small remainder taking a whole staging buffer); a unit's fp32
  master is one param of the base optimizer, so Adam's state exists per unit. Adam is
  elementwise, so stepping units one at a time gives the same bits as stepping the whole
  partition. Units bound what NVMe offload keeps in RAM.
  [Note: whole-partition units] An optimizer that is not elementwise on some param groups says
  so with `needs_whole_partitions(group)` (`MuonWithAuxAdam`: its Muon groups, whose
  Newton-Schulz step exchanges a whole partition's matrices with their owner ranks,
  zero/muon/owner_plan.py); such a group's partitions are one unit each, whatever their size.
  Under NVMe they have their own swapper and staging buffers, sized for them, so the elementwise
  units' buffers stay `unit_numel` ([Note: unit files] in offload/unit_files.py). Every rank
  holds the same units in the same order (equal partitions), so the owner exchanges, which are
  collectives, line up across ranks in either sweep direction.
- the step, per unit: gradient slice to host fp32 (a view when it is already there), multiply,
  base optimizer on that unit alone, then the updated master back into the partition: the fused
  copy-out of `DeepSpeedCPUAdam` for bf16/fp16 partitions (one pass), a copy for fp32. With an
  accelerator the copies to and from the device go through pinned buffers on a side stream.
- nvme: units live in `OptimizerSwapper` files (`UnitFiles`), read ahead and written behind around the step
  ([Note: read-ahead / write-behind] in offload/optimizer_swapper.py); the step sweeps them
  in alternating directions so the staging buffers act as a cache ([Note: alternating sweep]).
  A new unit's file gets its master and zero states; with `fast_init` only the master is written
  and the states are a file hole that reads back as zeros, so no zeros are staged or written
  (the same bits). Without nvme `fast_init` changes nothing: resident states are created by the
  first step anyway.
- checkpoints: `optimizer_state_dict()` / `master_partition()` materialise the state in the layout
  the wrapper would have without offload (one optimizer param per partition), so checkpoints are
  interchangeable between offload and no offload, and nothing of the swap files is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.ops.cpu_optimizer import CPUOptimizer
from zerospeed.runtime.grad_utils import scale_
from zerospeed.runtime.zero.offload.optimizer_swapper import OptimizerSwapper
from zerospeed.runtime.zero.offload.unit_files import UnitFiles, UnitLayout, check_swappable, unit_layout

__all__ = ["OffloadStates", "ResidentPartitions", "plan_units"]

_FP32 = torch.float32
_EMPTY = torch.empty(0, dtype=_FP32)


def plan_units(partition_numel: int, unit_numel: int) -> list[tuple[int, int]]:
    """(offset, numel) of the units a partition is cut into (pure)."""
    unit_numel = max(1, int(unit_numel))
    return [(offset, min(unit_numel, partition_numel - offset)) for offset in range(0, partition_numel, unit_numel)]


@dataclasses.dataclass
class _Unit:
    uid: int
    partition: int
    offset: int
    numel: int
    master: torch.Tensor        # the base optimizer's param (storage swapped out under nvme)
    group: dict[str, Any]       # the base optimizer param group it belongs to
    layout: UnitLayout          # whole or cut, and which states its nvme file holds


def _is_state_tensor(value: Any) -> bool:
    """An elementwise state tensor (exp_avg, ...) as opposed to a scalar such as torch's 0-dim `step`."""
    return torch.is_tensor(value) and value.dim() > 0


@contextlib.contextmanager
def _stepping_only(optimizer: torch.optim.Optimizer, unit: _Unit) -> Iterator[None]:
    """The base optimizer sees one param group holding only `unit.master` (same hyperparameters)."""
    groups = optimizer.param_groups
    optimizer.param_groups = [{**unit.group, "params": [unit.master]}]
    try:
        yield
    finally:
        optimizer.param_groups = groups


class ResidentPartitions:
    """How `OffloadStates` reaches the low-precision partitions when they are tensors in memory;
    stage 3 with `offload_param: nvme` swaps in `SwappedFlatAccess` (offload/param_swapper.py)."""

    def __init__(self, partitions: list[torch.Tensor]) -> None:
        self.partitions = partitions

    def view(self, index: int, offset: int, numel: int, read: bool = True) -> torch.Tensor:
        """Elements [offset, offset + numel) of partition `index`; `read=False`: the caller
        overwrites all of them, so their current values need not be fetched."""
        return self.partitions[index].narrow(0, offset, numel)

    def commit(self, index: int, offset: int, values: torch.Tensor) -> None:
        """`values` (from `view`) were changed: store them (a no-op for a view into memory)."""


class OffloadStates:
    def __init__(self, optimizer: torch.optim.Optimizer, offload_config: Any, aio_config: Any,
                 unit_numel: int, swap_name: str, kept_in_memory: tuple[str, ...] = ()) -> None:
        """`kept_in_memory`: state names nvme leaves out of the files ([Note: unit files])."""
        self.optimizer = optimizer
        self.aio_config = aio_config
        self.nvme = str(offload_config.device.value if hasattr(offload_config.device, "value")
                        else offload_config.device) == "nvme"
        self.fast_init = self.nvme and bool(offload_config.fast_init)
        self.unit_numel = max(1, int(unit_numel))
        self.accelerator = get_accelerator()
        self._pin = bool(offload_config.pin_memory) and torch.cuda.is_available()
        self._side_stream = self.accelerator.Stream() if torch.cuda.is_available() else None
        self.partitions: list[torch.Tensor] = []
        self.partition_access: ResidentPartitions = ResidentPartitions(self.partitions)
        self.units: list[_Unit] = []
        self._partition_units: list[list[int]] = []
        self._staging: dict[str, torch.Tensor] = {}
        self.kept_in_memory = tuple(kept_in_memory)
        self.files: UnitFiles | None = None
        self._live: set[int] = set()     # units whose state a step or a checkpoint wrote (nvme)
        self.peak_resident_bytes = 0
        self._num_sweeps = 0
        if self.nvme:
            check_swappable(optimizer)
            swap_root = os.path.join(str(offload_config.nvme_path), "zerospeed_offload", swap_name)
            self.files = UnitFiles(offload_config, aio_config, swap_root, self.unit_numel)

    @property
    def swapper(self) -> OptimizerSwapper | None:
        """The elementwise units' swapper (nvme); whole-partition units have their own (`files`)."""
        return self.files.elementwise if self.files is not None else None

    # --- registration ------------------------------------------------------------------------------
    def register(self, group: dict[str, Any], partition: torch.Tensor) -> list[torch.Tensor]:
        """Take over `partition` (this rank's flat low-precision slice); returns its fp32 unit masters,
        which the caller puts in `group["params"]`."""
        index = len(self.partitions)
        self.partitions.append(partition)
        uids = []
        # [Note: whole-partition units] an optimizer whose step on this group is not elementwise
        # (Muon's matrices) steps the partition as one unit; the cut would change its numbers.
        layout = unit_layout(self.optimizer, group, self.kept_in_memory)
        unit_numel = max(1, partition.numel()) if layout.whole else self.unit_numel
        for offset, numel in plan_units(partition.numel(), unit_numel):
            initial = partition.detach().narrow(0, offset, numel).to("cpu", _FP32)
            unit = _Unit(len(self.units), index, offset, numel, self._host_master(initial, layout), group, layout)
            self.units.append(unit)
            uids.append(unit.uid)
        self._partition_units.append(uids)
        return [self.units[uid].master for uid in uids]

    def _host_master(self, initial: torch.Tensor, layout: UnitLayout) -> torch.Tensor:
        if self.files is None:
            master = torch.empty(initial.numel(), dtype=_FP32, pin_memory=self._pin)
            return master.copy_(initial)
        self.files.create(len(self.units), layout, initial, self.fast_init)
        return _EMPTY.clone()

    # --- swap in / out (no-ops when resident) ------------------------------------------------------
    def _acquire(self, unit: _Unit) -> None:
        if self.files is None:
            return
        master, *states = self.files.of(unit.uid).swap_in(unit.uid)
        unit.master.data = master
        state = self.optimizer.state[unit.master]
        for key, value in unit.layout.fresh_scalars().items():
            state.setdefault(key, value)
        state.update(zip(unit.layout.swapped, states))
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.files.resident_unit_bytes())

    def _release(self, unit: _Unit, dirty: bool = True) -> None:
        if self.files is None:
            return
        if self._side_stream is not None:
            self._side_stream.synchronize()   # device copies from this buffer are done before reuse
        self.files.of(unit.uid).swap_out(unit.uid, dirty)
        unit.master.data = _EMPTY
        state = self.optimizer.state[unit.master]
        state.update({name: _EMPTY for name in unit.layout.swapped})

    def _units_in_order(self, uids: list[int] | None = None) -> Iterator[_Unit]:
        """Each unit swapped in, prefetching the following ones while the caller works on it."""
        order = list(range(len(self.units))) if uids is None else uids
        files = self.files
        if files is not None:
            files.begin_pass()
        ahead = 0
        for position, uid in enumerate(order):
            unit = self.units[uid]
            self._acquire(unit)          # first: a prefetch must never take the buffer this one needs
            if files is not None:
                ahead = max(ahead, position + 1)
                while ahead < len(order) and files.of(order[ahead]).prefetch(order[ahead]):
                    ahead += 1
            yield unit

    # --- the step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], multiplier: float) -> None:
        """One update of every unit from the partitioned `grads` (one per registered partition,
        same layout), multiplied by `multiplier` (unscale and clip) first."""
        cpu_optimizer = self.optimizer if isinstance(self.optimizer, CPUOptimizer) else None
        for unit in self._units_in_order(self._sweep_order()):
            grad = self._host_grad(grads[unit.partition].narrow(0, unit.offset, unit.numel))
            scale_([grad], multiplier)
            unit.master.grad = grad
            target = self.partition_access.view(unit.partition, unit.offset, unit.numel, read=False)
            half = cpu_optimizer is not None and target.dtype != _FP32
            host_half = self._host_half(target) if half else None
            with _stepping_only(self.optimizer, unit):
                if cpu_optimizer is not None and host_half is not None:
                    cpu_optimizer.step(fp16_param_groups=[[host_half]])
                else:
                    self.optimizer.step()
            unit.master.grad = None
            self._live.add(unit.uid)
            self._to_partition(target, host_half if host_half is not None else unit.master)
            self.partition_access.commit(unit.partition, unit.offset, target)
            self._release(unit)
        self._flush()

    def _sweep_order(self) -> list[int]:
        """[Note: alternating sweep] Units are independent (each stepped from its own state; a
        whole-partition unit's owner exchange pairs it with the same unit on every peer, which
        sweeps in the same order), so the order they are stepped in does not change a bit.
        Under nvme, every other step walks them backwards: the units the last step left in the
        staging buffers are the first ones this step needs, and are not read again ([Note:
        staging buffers as a write-back cache] in offload/optimizer_swapper.py)."""
        self._num_sweeps += 1
        order = list(range(len(self.units)))
        return order[::-1] if self.files is not None and self._num_sweeps % 2 == 0 else order

    def _host_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.device.type == "cpu":
            return grad if grad.dtype == _FP32 else grad.to(_FP32)
        staging = self._staging_buffer("grad", grad.numel(), _FP32)
        with self.accelerator.stream(self._side_stream):
            staging.copy_(grad, non_blocking=True)
        self._side_stream.synchronize()  # type: ignore[union-attr]
        return staging

    def _host_half(self, target: torch.Tensor) -> torch.Tensor:
        """Where the fused copy-out writes: the partition itself when it lives on the CPU."""
        if target.device.type == "cpu" and target.is_contiguous():
            return target
        return self._staging_buffer("half", target.numel(), target.dtype)

    def _to_partition(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if source.data_ptr() == target.data_ptr():
            return
        if target.device.type == "cpu":
            target.copy_(source)
            return
        with self.accelerator.stream(self._side_stream):
            target.copy_(source, non_blocking=True)
        self._side_stream.synchronize()  # type: ignore[union-attr]

    def _staging_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._staging.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            # a whole-partition unit ([Note: whole-partition units]) may exceed `unit_numel`
            buffer = torch.empty(max(self.unit_numel, numel), dtype=dtype, pin_memory=self._pin)
            self._staging[name] = buffer
        return buffer.narrow(0, 0, numel)

    # --- materialised views (checkpoints) ------------------------------------------------------------
    @torch.no_grad()
    def master_partition(self, index: int) -> torch.Tensor:
        """The fp32 master of registered partition `index`, as one new CPU tensor."""
        pieces = []
        for unit in self._units_in_order(self._partition_units[index]):
            pieces.append(unit.master.detach().clone())
            self._release(unit, dirty=False)
        return torch.cat(pieces)

    @torch.no_grad()
    def load_master_partition(self, index: int, values: torch.Tensor) -> None:
        """Set the fp32 master of partition `index` (full numel) and refresh the partition from it."""
        for unit in self._units_in_order(self._partition_units[index]):
            unit.master.copy_(values.narrow(0, unit.offset, unit.numel))
            target = self.partition_access.view(index, unit.offset, unit.numel, read=False)
            target.copy_(unit.master)
            self.partition_access.commit(index, unit.offset, target)
            self._release(unit)
        self._flush()

    def refresh_from_partitions(self) -> None:
        """Re-derive every master from its (just loaded) low-precision partition."""
        for index, uids in enumerate(self._partition_units):
            pieces = [self.partition_access.view(index, self.units[u].offset, self.units[u].numel).to("cpu", _FP32)
                      for u in uids]
            self.load_master_partition(index, torch.cat(pieces))

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The base optimizer's state_dict as it would be with one param per partition."""
        state: dict[int, dict[str, Any]] = {}
        for index, uids in enumerate(self._partition_units):
            merged = self._merged_state(uids)
            if merged:
                state[index] = merged
        groups, by_group = [], self._partitions_by_group()
        for group in self.optimizer.param_groups:
            saved = {key: value for key, value in group.items() if key != "params"}
            groups.append({**saved, "params": by_group.get(id(group), [])})
        return {"state": state, "param_groups": groups}

    def _merged_state(self, uids: list[int]) -> dict[str, Any]:
        pieces: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, Any] = {}
        for unit in self._units_in_order(uids):
            for key, value in self.optimizer.state.get(unit.master, {}).items():
                if _is_state_tensor(value):
                    pieces.setdefault(key, []).append(value.detach().clone())
                else:
                    scalars.setdefault(key, value.clone() if torch.is_tensor(value) else value)
            self._release(unit, dirty=False)
        if self.files is not None and not self._live.intersection(uids):
            return {}     # never stepped: the state is the zeros created with the files
        return {**scalars, **{key: torch.cat(values) for key, values in pieces.items()}}

    def _partitions_by_group(self) -> dict[int, list[int]]:
        by_group: dict[int, list[int]] = {}
        for index, uids in enumerate(self._partition_units):
            by_group.setdefault(id(self.units[uids[0]].group), []).append(index)
        return by_group

    @torch.no_grad()
    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})
        saved_state = {int(key): value for key, value in state_dict["state"].items()}
        for index, uids in enumerate(self._partition_units):
            entry = saved_state.get(index, {})
            for unit in self._units_in_order(uids):
                self._load_unit_state(unit, entry)
                self._release(unit)
        self._flush()

    def _load_unit_state(self, unit: _Unit, entry: dict[str, Any]) -> None:
        state = self.optimizer.state[unit.master]
        if entry:
            self._live.add(unit.uid)
        for key, value in entry.items():
            if _is_state_tensor(value):
                piece = value.reshape(-1).narrow(0, unit.offset, unit.numel)
                existing = state.get(key)
                if existing is not None and existing.numel() == unit.numel:
                    existing.copy_(piece)      # under nvme: the staging buffer, written back below
                else:
                    state[key] = piece.to(_FP32).clone()
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value

    def _flush(self) -> None:
        if self.files is not None:
            self.files.flush()

    # --- accounting / cleanup ------------------------------------------------------------------------
    def resident_state_bytes(self) -> int:
        """Bytes of master and optimizer-state tensors in RAM right now (staging buffers aside)."""
        total = 0
        for unit in self.units:
            total += unit.master.numel() * unit.master.element_size()
            for value in self.optimizer.state.get(unit.master, {}).values():
                if _is_state_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def memory_breakdown(self) -> dict[str, int]:
        masters = sum(u.master.numel() * u.master.element_size() for u in self.units)
        return {"master_params": masters, "optimizer_states": self.resident_state_bytes() - masters,
                "staging_buffers": self.files.staging_bytes if self.files is not None else 0}

    def close(self) -> None:
        """Wait for I/O and remove the swap files (also done at garbage collection and exit)."""
        if self.files is not None:
            self.files.close()


def build_offload_states(optimizer: torch.optim.Optimizer, config: Any, dp_group: Any, module: torch.nn.Module,
                         param_dtype: torch.dtype) -> OffloadStates | None:
    """The host-memory check (always, when anything is offloaded), then the holder when the
    optimizer is offloaded; None without optimizer offload."""
    from zerospeed import comm
    from zerospeed.runtime.zero.offload.host_memory_check import (
        check_host_memory,
        local_ranks_from_env,
        offloaded_numel,
        plan_host_bytes,
        swap_unit_numel,
        whole_units_of,
    )

    zero_config = config.zero_config
    block = zero_config.offload_optimizer
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)
    num_states = len(getattr(optimizer, "STATE_NAMES", ("exp_avg", "exp_avg_sq")))
    element_bytes = torch.empty(0, dtype=param_dtype).element_size()
    world_size = comm.get_world_size(dp_group)
    offloaded = offloaded_numel(optimizer.param_groups, zero_config, world_size)
    unit_numel = swap_unit_numel(optimizer.param_groups, zero_config, world_size)
    # DeepSpeed's key: the Muon momentum stays in host memory, out of the nvme files ([Note: unit files])
    kept = ("momentum_buffer",) if zero_config.save_muon_momentum_buffer_in_memory else ()
    check_host_memory(plan_host_bytes(numel, world_size, zero_config, num_states, element_bytes,
                                      local_ranks_from_env(), offloaded, unit_numel,
                                      whole_units_of(optimizer, zero_config, world_size, kept)))
    if block is None or not block.enabled:
        return None
    swap_name = f"rank{comm.get_rank():02d}_pid{os.getpid()}"
    return OffloadStates(optimizer, block, config.aio_config, unit_numel, swap_name, kept)
