"""Up-front host-RAM check for ZeRO-Offload: stop at `initialize` with the numbers, instead of
the kernel's OOM killer stopping the run later.

`plan_host_bytes` is pure arithmetic over the model size: what one rank will allocate in host
memory for the offloaded tensors (DeepSpeed's `deepspeed/runtime/zero/stage3.py::
estimate_zero3_model_states_mem_needs` counts the same things, coarser):

- optimizer offload `cpu`: fp32 master (4 B) + optimizer states (4 B each: Adam 2, Adagrad and
  Lion 1) per element of this rank's partition, plus, for a bf16/fp16 model, the low-precision
  host copy of the partition when an accelerator holds the real one;
- optimizer offload `nvme`: only the staging buffers, `buffer_count` units times (1 + states),
  a unit being `sub_group_size` elements at stages 1 and 2 and the largest sub-group (at most
  twice `sub_group_size`) at stage 3 (`swap_unit_numel`); plus, for param groups stepped whole
  (Muon's, `whole_partition_numels`), their own buffers: one per such partition up to
  `buffer_count`, each the largest of them times (1 + their swapped states), and any state
  kept in memory (`save_muon_momentum_buffer_in_memory`) for all of them;
- parameter offload `cpu` (stage 3): the parameter partition in its dtype.

With `offload_optimizer.ratio < 1` (stage 3) the optimizer terms count only the offloaded
sub-groups' elements (`offloaded_numel`, from ../sub_groups.py); the rest stays on the accelerator.

Every rank of a node allocates its own share, so the node needs `local ranks x per rank`;
`check_host_memory` compares that with psutil's available memory and raises `ValueError`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["HostMemoryPlan", "WholeUnits", "check_host_memory", "offloaded_numel", "plan_host_bytes",
           "swap_unit_numel", "whole_partition_numels", "whole_units_of"]

_GIB = 2**30
_STATES_PER_OPTIMIZER = {"adam": 2, "adamw": 2, "adagrad": 1, "lion": 1}


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    per_rank_bytes: dict[str, int]      # what -> bytes, for one rank
    local_ranks: int

    @property
    def needed_bytes(self) -> int:
        return sum(self.per_rank_bytes.values()) * self.local_ranks


@dataclasses.dataclass(frozen=True)
class WholeUnits:
    """The whole-partition swap units of one rank ([Note: unit files] in unit_files.py)."""

    numels: list[int]          # one per partition stepped whole
    num_swapped_states: int    # state tensors in each unit's file, beside the master
    num_kept_states: int = 0   # state tensors kept in host memory instead


def _device_name(block: Any) -> str:
    device = getattr(block, "device", "none") if block is not None else "none"
    return str(getattr(device, "value", device))


def plan_host_bytes(numel: int, dp_world_size: int, zero_config: Any, num_states: int = 2,
                    param_element_bytes: int = 4, local_ranks: int = 1,
                    offloaded_numel: int | None = None, unit_numel: int | None = None,
                    whole_units: WholeUnits | None = None) -> HostMemoryPlan:
    """Host bytes one rank allocates for the offloaded tensors of a model of `numel` elements;
    `offloaded_numel`: the elements of this rank's partition the optimizer offload holds (all of
    them when None); `unit_numel`: the largest swap unit (`swap_unit_numel`; `sub_group_size`
    when None)."""
    partition = -(-numel // max(1, dp_world_size))
    offloaded = partition if offloaded_numel is None else offloaded_numel
    optimizer_block, param_block = zero_config.offload_optimizer, zero_config.offload_param
    parts: dict[str, int] = {}
    optimizer_device = _device_name(optimizer_block)
    if optimizer_device == "cpu":
        parts["fp32 master partition"] = 4 * offloaded
        parts[f"optimizer states ({num_states} x fp32)"] = 4 * num_states * offloaded
        if param_element_bytes < 4:
            parts["low-precision copy-out staging"] = param_element_bytes * offloaded
    elif optimizer_device == "nvme":
        unit = min(offloaded, max(1, int(zero_config.sub_group_size) if unit_numel is None else unit_numel))
        count = optimizer_block.buffer_count
        parts[f"nvme staging buffers ({count} x {unit} elements)"] = count * 4 * (1 + num_states) * unit
        if whole_units is not None and whole_units.numels:
            _add_whole_units(parts, whole_units, count)
    if _device_name(param_block) == "cpu" and int(zero_config.stage) == 3:
        parts["parameter partition"] = param_element_bytes * partition
    return HostMemoryPlan(parts, max(1, local_ranks))


def _add_whole_units(parts: dict[str, int], whole: WholeUnits, buffer_count: int) -> None:
    count, largest = min(buffer_count, len(whole.numels)), max(whole.numels)
    parts[f"nvme staging buffers for whole partitions ({count} x {largest} elements)"] = \
        count * 4 * (1 + whole.num_swapped_states) * largest
    if whole.num_kept_states:
        parts[f"states kept in memory ({whole.num_kept_states} x fp32)"] = \
            4 * whole.num_kept_states * sum(whole.numels)


def whole_partition_numels(param_groups: list[dict[str, Any]], whole: list[bool], zero_config: Any,
                           dp_world_size: int) -> list[int]:
    """This rank's partitions of the param groups flagged in `whole` ([Note: whole-partition
    units] in offload_states.py): one per group at stages 1 and 2 (alignment padding left out),
    one per sub-group at stage 3."""
    from zerospeed.runtime.zero.sub_groups import sub_group_numels

    groups = [group for group, flag in zip(param_groups, whole) if flag]
    if int(zero_config.stage) == 3:
        return sub_group_numels(_partition_numels(groups, dp_world_size), max(1, int(zero_config.sub_group_size)))
    totals = [sum(int(getattr(p, "ds_numel", p.numel())) for p in group["params"] if p.requires_grad)
              for group in groups]
    return [-(-total // max(1, dp_world_size)) for total in totals if total]


def whole_units_of(optimizer: Any, zero_config: Any, dp_world_size: int,
                   kept_in_memory: tuple[str, ...]) -> WholeUnits | None:
    """This rank's whole-partition units for `optimizer`'s param groups (None without any)."""
    from zerospeed.runtime.zero.offload.unit_files import unit_layout

    layouts = [unit_layout(optimizer, group, kept_in_memory) for group in optimizer.param_groups]
    whole = [layout for layout in layouts if layout.whole]
    if not whole:
        return None
    numels = whole_partition_numels(optimizer.param_groups, [layout.whole for layout in layouts], zero_config,
                                    dp_world_size)
    return WholeUnits(numels, max(len(layout.swapped) for layout in whole),
                      max(len(layout.in_memory) for layout in whole))


def offloaded_numel(param_groups: list[dict[str, Any]], zero_config: Any, dp_world_size: int) -> int | None:
    """Stage 3 with `offload_optimizer.ratio < 1`: this rank's elements in offloaded sub-groups, cut
    as stage 3 will cut the optimizer's `param_groups`; None (everything) otherwise."""
    from zerospeed.runtime.zero.sub_groups import offloaded_partition_numel

    block = zero_config.offload_optimizer
    if block is None or float(block.ratio) >= 1 or int(zero_config.stage) != 3:
        return None
    numels = _partition_numels(param_groups, dp_world_size)
    return offloaded_partition_numel(numels, int(zero_config.sub_group_size), float(block.ratio))


def swap_unit_numel(param_groups: list[dict[str, Any]], zero_config: Any, dp_world_size: int) -> int:
    """The most elements `OffloadStates` puts in one swap unit. Stages 1 and 2: `sub_group_size`
    (a param group's partition is cut into units of that size). Stage 3: the largest sub-group
    (sub_groups.py), so each sub-group is swapped whole as in DeepSpeed and no small remainder
    unit takes a whole staging buffer; but at most `2 * sub_group_size`, so a parameter partition
    far larger than `sub_group_size` is still cut and the staging memory stays bounded by it."""
    from zerospeed.runtime.zero.sub_groups import largest_sub_group_numel

    sub_group_size = max(1, int(zero_config.sub_group_size))
    if int(zero_config.stage) != 3:
        return sub_group_size
    largest = largest_sub_group_numel(_partition_numels(param_groups, dp_world_size), sub_group_size)
    return max(1, min(largest, 2 * sub_group_size))


def _partition_numels(param_groups: list[dict[str, Any]], dp_world_size: int) -> list[list[int]]:
    """Per param group, this rank's partition numel of each trainable parameter, in order."""
    from zerospeed.runtime.zero.param_state import partition_numel

    return [[partition_numel(int(getattr(p, "ds_numel", p.numel())), dp_world_size)
             for p in group["params"] if p.requires_grad] for group in param_groups]


def available_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def local_ranks_from_env() -> int:
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def check_host_memory(plan: HostMemoryPlan, available_bytes: int | None = None) -> None:
    """ValueError naming what is needed, what is available and what to change, if it cannot fit."""
    if not plan.per_rank_bytes:
        return
    available = available_host_bytes() if available_bytes is None else available_bytes
    if plan.needed_bytes <= available:
        return
    lines = "\n".join(f"  {name}: {value / _GIB:.3f} GiB" for name, value in plan.per_rank_bytes.items())
    raise ValueError(
        f"ZeRO-Offload needs {plan.needed_bytes / _GIB:.3f} GiB of host memory on this node "
        f"({plan.local_ranks} local rank(s) x {sum(plan.per_rank_bytes.values()) / _GIB:.3f} GiB), but only "
        f"{available / _GIB:.3f} GiB is available. Per rank:\n{lines}\n"
        "To fit: set zero_optimization.offload_optimizer.device to 'nvme' (with nvme_path), lower "
        "offload_optimizer.buffer_count or zero_optimization.sub_group_size (nvme), spread the model over "
        "more data-parallel ranks / nodes, or free host memory.")
