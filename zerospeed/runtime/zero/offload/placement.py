"""Where each stage-3 sub-group's fp32 master and optimizer state live, decided once per run
(`build_placement`), so the wrapper (stage3.py) asks one object instead of branching.

[Note: sub-group placement]
Two config blocks place sub-group k's tensors, independently:
- `offload_param` places its partitions `lp_flat[k]`: on the device, in host memory or in a swap
  file (`PartitionHome`, offload/partition_home.py).
- `offload_optimizer` places its fp32 master and optimizer state. `DevicePlacement` (no block):
  every master on the compute device, stepped by the base optimizer. `OffloadPlacement`: the
  first `num_on_device` sub-groups (sub_groups.py; all but none unless `ratio < 1`) keep their
  master on the device, stepped by the torch twin of the CPU optimizer ([Note: partial offload]
  in partial_offload.py), and the rest belong to `OffloadStates` (host or NVMe), whose partition
  `k - num_on_device` sub-group k is; their `fp32_flat[k]` is a stand-in wrapping `lp_flat[k]`,
  their gradient buffer a host buffer written through the `HostGradientSink` ([Note: offloaded
  gradients at stage 3] in stage3_gradients.py).
The placement answers, per sub-group: its master and gradient buffer at construction, what the
base optimizer's param group holds, the step, the write back of the updated masters into the
partitions, and the checkpoint view (one optimizer param per sub-group whatever the placement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.base_optimizer import optimizer_state_tensors, tensor_bytes
from zerospeed.runtime.chunked_step import step_in_chunks
from zerospeed.runtime.config_sections import AioConfig
from zerospeed.runtime.grad_utils import scale_
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.offload.offload_states import OffloadStates
from zerospeed.runtime.zero.offload.param_swapper import SwappedFlatAccess
from zerospeed.runtime.zero.offload.partial_offload import (build_device_optimizer, load_device_state,
                                                            merge_state_dicts, split_state_dict)
from zerospeed.runtime.zero.offload.partition_home import PartitionHome, build_partition_home
from zerospeed.runtime.zero.param_state import ZeroParameter
from zerospeed.runtime.zero.sub_groups import num_sub_groups_on_device

__all__ = ["DevicePlacement", "OffloadPlacement", "SubGroupPlacement", "build_placement", "resolve_aio_config"]

Masters = list[torch.nn.Parameter]


def _step_on_device(optimizer: torch.optim.Optimizer | None, masters: Masters, grads: list[torch.Tensor],
                    multiplier: float) -> None:
    """Step the masters kept on the device with their gradients times `multiplier`."""
    if not masters:
        return
    master_grads = [grad if grad.dtype == master.dtype else grad.float() for master, grad in zip(masters, grads)]
    for master, grad in zip(masters, master_grads):
        master.grad = grad
    scale_(master_grads, multiplier)
    step_in_chunks(optimizer)  # type: ignore[arg-type]  # [Note: chunked optimizer step]


def _for_host_add(reduced: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the sink adds into a host `dtype` buffer: `reduced` itself when widening it to `dtype`
    is exact (the host add then gives the bits of the device path's convert-then-add), else
    `reduced` converted on the device, which rounds exactly as the path without offload does."""
    return reduced if torch.promote_types(reduced.dtype, dtype) == dtype else reduced.to(dtype)


class SubGroupPlacement:
    """What both placements share: the partitions' home, the device optimizer and its sub-groups."""

    offload: OffloadStates | None = None
    sink: HostGradientSink | None = None

    def __init__(self, optimizer: torch.optim.Optimizer, partitions: PartitionHome, num_on_device: int) -> None:
        self.optimizer = optimizer
        self.partitions = partitions
        self.num_on_device = num_on_device
        self.device_optimizer: torch.optim.Optimizer | None = optimizer

    def offloaded(self, sub_group: int) -> bool:
        """Whether `OffloadStates` holds this sub-group (as its partition `sub_group - num_on_device`)."""
        return sub_group >= self.num_on_device

    # --- construction, sub-group by sub-group, then group by group -------------------------------
    def master(self, index: int, lp: torch.Tensor) -> torch.nn.Parameter:
        """Sub-group `index`'s fp32 master, given its partitions `lp` (already in their home)."""
        raise NotImplementedError

    def grad_buffer(self, sub_group: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Sub-group `sub_group`'s gradient partitions, zeroed; beside its master."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def adopt(self, group: dict[str, Any], masters: Masters, start: int) -> None:
        """Fill the base optimizer's param `group` from its sub-groups' `masters` (the first is `start`)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Every param group adopted: build what steps the device masters."""

    # --- how reduced gradients reach the buffers ------------------------------------------------
    def add_reduced(self, sub_group: int, dest: torch.Tensor, reduced: torch.Tensor) -> None:
        """`dest += reduced`: `dest` a slice of sub-group `sub_group`'s gradient buffer, `reduced`
        a slice of a slab buffer that is refilled once this returns."""
        dest.add_(reduced.to(dest.device, dest.dtype))   # host with `offload_param` alone

    def gradients_complete(self) -> None:
        """End of a reduction pass: every `add_reduced` has landed in its buffer."""

    # --- the step --------------------------------------------------------------------------------
    def step(self, masters: Masters, grads: list[torch.Tensor], multiplier: float) -> None:
        _step_on_device(self.device_optimizer, masters[:self.num_on_device], grads[:self.num_on_device], multiplier)

    @torch.no_grad()
    def publish(self, masters: Masters, lp_flat: list[torch.Tensor]) -> None:
        """The updated masters into the partitions the next forward gathers."""
        for index, (master, lp) in enumerate(zip(masters, lp_flat)):
            master.grad = None
            self.partitions.write_back(index, master, lp)

    @torch.no_grad()
    def refresh_masters(self, masters: Masters, lp_flat: list[torch.Tensor]) -> None:
        """Re-derive the device masters from the (just loaded) partitions."""
        for index, (master, lp) in enumerate(zip(masters[:self.num_on_device], lp_flat)):
            self.partitions.read_master(index, master, lp)

    # --- the partitions' home ------------------------------------------------------------------
    def swap_out(self, lp_flat: list[torch.Tensor], masters: Masters, groups: list[list[ZeroParameter]],
                 offset_of: Callable[[ZeroParameter], int]) -> None:
        """`offload_param: nvme`: partitions beyond `max_in_cpu` to files, dropped from memory."""
        def drop(index: int, stand_in: torch.Tensor) -> None:
            lp_flat[index] = stand_in
            self._drop_master(index, stand_in, masters)

        self.partitions.swap_out(lp_flat, groups, offset_of, drop)

    def _drop_master(self, index: int, stand_in: torch.Tensor, masters: Masters) -> None:
        """A device master is a separate copy (offload_param alone): it stays."""

    # --- checkpoints: one optimizer param per sub-group, whatever the placement ----------------
    def optimizer_state_dict(self, masters: Masters, group_ranges: list[range]) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, saved: dict[str, Any], masters: Masters) -> None:
        self.optimizer.load_state_dict(saved)

    def master_copy(self, index: int, masters: Masters) -> torch.Tensor:
        """Sub-group `index`'s fp32 master as a new tensor."""
        return masters[index].detach().float().clone()

    def load_master(self, index: int, saved: torch.Tensor, masters: Masters) -> None:
        masters[index].copy_(saved)

    # --- accounting -----------------------------------------------------------------------------
    def state_bytes(self, masters: Masters, separate_master: bool) -> dict[str, int]:
        """Bytes of the fp32 masters (when separate from the partitions) and of the optimizer state."""
        device = self.device_optimizer
        return {"master_params": tensor_bytes(masters[:self.num_on_device]) if separate_master else 0,
                "optimizer_states": tensor_bytes(optimizer_state_tensors(device)) if device is not None else 0}

    def device_state_tensors(self) -> list[torch.Tensor]:
        """The optimizer state kept on the device (what `offload_states` may move)."""
        return [] if self.device_optimizer is None else optimizer_state_tensors(self.device_optimizer)

    def subgroup_to_device(self, num_sub_groups: int) -> dict[int, str]:
        """With `offload_optimizer`: where each sub-group's master and optimizer state live."""
        return {}

    def close(self) -> None:
        self.partitions.close()


class DevicePlacement(SubGroupPlacement):
    """No `offload_optimizer`: every master on the compute device, stepped by the base optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, partitions: PartitionHome, num_sub_groups: int,
                 compute_device: torch.device) -> None:
        super().__init__(optimizer, partitions, num_sub_groups)
        self.compute_device = compute_device

    def master(self, index: int, lp: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(self.partitions.device_master(lp, self.compute_device))

    def adopt(self, group: dict[str, Any], masters: Masters, start: int) -> None:
        """The base optimizer's param group holds the sub-groups' masters."""
        group["params"] = masters


class OffloadPlacement(SubGroupPlacement):
    """`offload_optimizer`: the first `num_on_device` sub-groups on the device, the rest in `OffloadStates`."""

    def __init__(self, optimizer: torch.optim.Optimizer, offload: OffloadStates, partitions: PartitionHome,
                 num_sub_groups: int, block: Any) -> None:
        self.ratio = float(block.ratio)   # [Note: partial offload] in partial_offload.py
        super().__init__(optimizer, partitions, num_sub_groups_on_device(num_sub_groups, self.ratio))
        self.offload = offload
        # [Note: offloaded gradients at stage 3] in stage3_gradients.py
        self.sink = HostGradientSink(bool(block.pin_memory))
        self._on_device: list[Masters] = []

    def master(self, index: int, lp: torch.Tensor) -> torch.nn.Parameter:
        if self.offloaded(index):   # a stand-in: OffloadStates holds the real master
            return torch.nn.Parameter(lp)
        return torch.nn.Parameter(lp if lp.dtype == torch.float32 else lp.float())

    def grad_buffer(self, sub_group: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.offloaded(sub_group):
            return self.sink.host_buffer(numel, dtype)  # type: ignore[union-attr]
        return super().grad_buffer(sub_group, numel, dtype, device)

    def add_reduced(self, sub_group: int, dest: torch.Tensor, reduced: torch.Tensor) -> None:
        if not self.offloaded(sub_group):
            super().add_reduced(sub_group, dest, reduced)
            return
        # [Note: offloaded gradients at stage 3] in stage3_gradients.py
        values = _for_host_add(reduced, dest.dtype)
        if values.device.type != "cpu" and values.data_ptr() == reduced.data_ptr():
            values = values.clone()   # the sink reads it on its own stream, after the refill
        self.sink.add(dest, values)  # type: ignore[union-attr]

    def gradients_complete(self) -> None:
        self.sink.synchronize()  # type: ignore[union-attr]

    def adopt(self, group: dict[str, Any], masters: Masters, start: int) -> None:
        """The offloaded sub-groups registered with `OffloadStates`, in order; the base optimizer's
        param group holds their units, the device optimizer's (built by `finish`) the rest."""
        self._on_device.append([m for k, m in enumerate(masters, start) if not self.offloaded(k)])
        group["params"] = [unit for k, m in enumerate(masters, start) if self.offloaded(k)
                           for unit in self.offload.register(group, m.data)]  # type: ignore[union-attr]

    def finish(self) -> None:
        """The device sub-groups' optimizer: the CPU optimizer's torch twin with `ratio < 1`, else none."""
        self.device_optimizer = build_device_optimizer(self.optimizer, self._on_device) if self.ratio < 1 else None

    def step(self, masters: Masters, grads: list[torch.Tensor], multiplier: float) -> None:
        super().step(masters, grads, multiplier)
        self.offload.step(grads[self.num_on_device:], multiplier)  # type: ignore[union-attr]

    @torch.no_grad()
    def publish(self, masters: Masters, lp_flat: list[torch.Tensor]) -> None:
        # The offloaded partitions, swapped ones included, were written by OffloadStates' step.
        for master, lp in zip(masters, lp_flat):
            master.grad = None
            if master.data_ptr() != lp.data_ptr():
                lp.copy_(master)

    @torch.no_grad()
    def refresh_masters(self, masters: Masters, lp_flat: list[torch.Tensor]) -> None:
        self.offload.refresh_from_partitions()  # type: ignore[union-attr]
        for master, lp in zip(masters[:self.num_on_device], lp_flat):
            if master.data_ptr() != lp.data_ptr():
                master.copy_(lp)

    def swap_out(self, lp_flat: list[torch.Tensor], masters: Masters, groups: list[list[ZeroParameter]],
                 offset_of: Callable[[ZeroParameter], int]) -> None:
        super().swap_out(lp_flat, masters, groups, offset_of)
        swapper = self.partitions.swapper
        if swapper is not None:   # OffloadStates reads and writes the swapped partitions in their files
            offload = self.offload
            assert offload is not None
            # the same interface as ResidentPartitions, not a subclass
            offload.partition_access = SwappedFlatAccess(  # type: ignore[assignment]
                swapper, offload.partitions, self.partitions.swapped)

    def _drop_master(self, index: int, stand_in: torch.Tensor, masters: Masters) -> None:
        masters[index].data = stand_in
        self.offload.partitions[index] = stand_in  # type: ignore[union-attr]

    def optimizer_state_dict(self, masters: Masters, group_ranges: list[range]) -> dict[str, Any]:
        offloaded = self.offload.optimizer_state_dict()  # type: ignore[union-attr]
        if self.device_optimizer is None:
            return offloaded
        return merge_state_dicts(self.device_optimizer, masters[:self.num_on_device], offloaded, group_ranges)

    def load_optimizer_state_dict(self, saved: dict[str, Any], masters: Masters) -> None:
        offload = self.offload
        assert offload is not None
        if self.device_optimizer is None:
            offload.load_optimizer_state_dict(saved)
            return
        device, offloaded = split_state_dict(saved, self.num_on_device)
        offload.load_optimizer_state_dict(offloaded)
        load_device_state(self.device_optimizer, masters[:self.num_on_device], device)

    def master_copy(self, index: int, masters: Masters) -> torch.Tensor:
        if self.offloaded(index):
            return self.offload.master_partition(index - self.num_on_device)  # type: ignore[union-attr]
        return super().master_copy(index, masters)

    def load_master(self, index: int, saved: torch.Tensor, masters: Masters) -> None:
        if self.offloaded(index):
            self.offload.load_master_partition(index - self.num_on_device, saved)  # type: ignore[union-attr]
        else:
            super().load_master(index, saved, masters)

    def state_bytes(self, masters: Masters, separate_master: bool) -> dict[str, int]:
        kept = super().state_bytes(masters, separate_master)
        offloaded = self.offload.memory_breakdown()  # type: ignore[union-attr]
        return {key: kept[key] + offloaded[key] for key in kept}

    def subgroup_to_device(self, num_sub_groups: int) -> dict[int, str]:
        device = get_accelerator().device_name()
        return {k: "cpu" if self.offloaded(k) else device for k in range(num_sub_groups)}

    def close(self) -> None:
        super().close()
        self.offload.close()  # type: ignore[union-attr]


def resolve_aio_config(aio_config: Any, offload: OffloadStates | None) -> Any:
    """The `aio` block the swap files use: the one given, else the optimizer holder's, else the defaults."""
    if aio_config is not None:
        return aio_config
    return offload.aio_config if offload is not None else AioConfig()  # type: ignore[call-arg]  # every field has a default


def build_placement(optimizer: torch.optim.Optimizer, zero_config: Any, offload: OffloadStates | None,
                    aio_config: Any, num_sub_groups: int, compute_device: torch.device) -> SubGroupPlacement:
    """The run's one placement decision: `offload_param` gives the partitions' home, the holder
    `offload` (built when `offload_optimizer` is on) the masters'."""
    partitions = build_partition_home(zero_config.offload_param, aio_config)
    if offload is None:
        return DevicePlacement(optimizer, partitions, num_sub_groups, compute_device)
    return OffloadPlacement(optimizer, offload, partitions, num_sub_groups, zero_config.offload_optimizer)
