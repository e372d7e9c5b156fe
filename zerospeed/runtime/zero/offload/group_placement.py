"""Where a ZeRO 1/2 param group's fp32 master partition and optimizer state live, decided once per
run (`build_group_placement`), so the wrapper (stage_1_and_2.py) asks one object instead of
branching on `offload_optimizer`. Stage 3's counterpart, per sub-group, is placement.py.

- `GroupPlacement` (no `offload_optimizer`): the master on the device, this rank's partition of the
  flat low-precision buffer itself in fp32 ([Note: fp32 master sharing] in stage_1_and_2.py), a
  clone otherwise; the base optimizer's group holds it and steps it; the gradient partition the
  step reads is on the device.
- `OffloadGroupPlacement`: the master and optimizer state belong to `OffloadStates` (host memory
  or NVMe), which steps them and writes the partition back; the wrapper's `master` is the
  low-precision partition itself; the gradient partition the step reads is a host buffer written
  through a `HostGradientSink` ([Note: offloaded gradients] in stage_1_and_2.py), and the step's
  scalar collectives run on the accelerator (`comm_device`).
Checkpoints hold the layout without offload either way (one optimizer param per group).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.base_optimizer import optimizer_state_tensors, tensor_bytes
from zerospeed.runtime.chunked_step import step_in_chunks
from zerospeed.runtime.grad_utils import scale_
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.offload.offload_states import OffloadStates

__all__ = ["GroupPlacement", "OffloadGroupPlacement", "build_group_placement"]

_MASTER_DTYPE = torch.float32


class GroupPlacement:
    """No `offload_optimizer`: every master on the device, stepped by the base optimizer."""

    offload: OffloadStates | None = None
    sink: HostGradientSink | None = None
    comm_device: torch.device | None = None    # None: the gradients' own device

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    # --- construction --------------------------------------------------------------------------
    def master(self, group: dict[str, Any], lp_partition: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 master of param `group`, whose partition is `lp_partition`; fills `group["params"]`."""
        master = lp_partition if lp_partition.dtype == _MASTER_DTYPE else lp_partition.to(_MASTER_DTYPE).clone()
        group["params"] = [master]
        return master

    def grad_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer of partition gradients the step reads (stage 2 accumulates in it)."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def partition_grad(self, accumulated: torch.Tensor) -> torch.Tensor:
        """Stage 1: what the step reads of this rank's partition of the full accumulated gradients."""
        return accumulated

    # --- the step --------------------------------------------------------------------------------
    def gradients_complete(self) -> None:
        """End of backward: every reduced gradient is in the partition the step reads."""

    def step(self, masters: list[torch.Tensor], grads: list[torch.Tensor], multiplier: float) -> None:
        """The masters from their partition gradients times `multiplier` (unscale and clip)."""
        for master, grad in zip(masters, grads):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        scale_([m.grad for m in masters], multiplier)  # type: ignore[misc]  # every grad set above
        step_in_chunks(self.optimizer)   # [Note: chunked optimizer step]
        for master in masters:
            master.grad = None

    @torch.no_grad()
    def refresh_master(self, index: int, master: torch.Tensor, lp_partition: torch.Tensor) -> None:
        """Group `index`'s master re-derived from its (just loaded) low-precision partition."""
        if master.data_ptr() != lp_partition.data_ptr():
            master.copy_(lp_partition)

    # --- checkpoints ---------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(saved)

    def master_partition(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """Group `index`'s fp32 master partition (padding included)."""
        return master

    @torch.no_grad()
    def load_master(self, index: int, master: torch.Tensor, lp_partition: torch.Tensor, saved: torch.Tensor,
                    from_fp32_weights: bool) -> None:
        """The master of group `index` from the checkpoint's `saved` (padding left out: zeros) when
        `from_fp32_weights`, else from the loaded `lp_partition`."""
        if not from_fp32_weights:
            self.refresh_master(index, master, lp_partition)
            return
        master.narrow(0, 0, saved.numel()).copy_(saved)
        master.narrow(0, saved.numel(), master.numel() - saved.numel()).zero_()

    # --- accounting ------------------------------------------------------------------------------
    def held_state(self, masters: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the masters, the optimizer state) this placement keeps with the wrapper's tensors."""
        return list(masters), optimizer_state_tensors(self.optimizer)

    def state_bytes(self, separate_masters: list[torch.Tensor]) -> dict[str, int]:
        """Bytes of the masters (those separate from the partitions) and of the optimizer state."""
        return {"master_params": tensor_bytes(separate_masters),
                "optimizer_states": tensor_bytes(optimizer_state_tensors(self.optimizer))}


class OffloadGroupPlacement(GroupPlacement):
    """`offload_optimizer`: masters and optimizer state in `OffloadStates`, gradients to the host."""

    def __init__(self, optimizer: torch.optim.Optimizer, offload: OffloadStates, block: Any) -> None:
        super().__init__(optimizer)
        self.offload = offload
        self.sink = HostGradientSink(bool(getattr(block, "pin_memory", True)))
        # [Note: offloaded gradients] host gradients: the step's scalar collectives run here.
        self.comm_device = torch.device(get_accelerator().current_device_name())

    def master(self, group: dict[str, Any], lp_partition: torch.Tensor) -> torch.Tensor:
        group["params"] = self._holder.register(group, lp_partition)
        return lp_partition

    def grad_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._sink.host_buffer(numel, dtype)

    def partition_grad(self, accumulated: torch.Tensor) -> torch.Tensor:
        # the device-side full flat gradients keep accumulating; the reduction writes a host copy
        return self._sink.host_buffer(accumulated.numel(), accumulated.dtype)

    def gradients_complete(self) -> None:
        self._sink.synchronize()   # the host ops of every reduced bucket have run

    def step(self, masters: list[torch.Tensor], grads: list[torch.Tensor], multiplier: float) -> None:
        self._holder.step(grads, multiplier)

    @torch.no_grad()
    def refresh_master(self, index: int, master: torch.Tensor, lp_partition: torch.Tensor) -> None:
        self._holder.load_master_partition(index, lp_partition.detach().to("cpu", _MASTER_DTYPE))

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self._holder.optimizer_state_dict()

    def load_optimizer_state_dict(self, saved: dict[str, Any]) -> None:
        self._holder.load_optimizer_state_dict(saved)

    def master_partition(self, index: int, master: torch.Tensor) -> torch.Tensor:
        return self._holder.master_partition(index)

    @torch.no_grad()
    def load_master(self, index: int, master: torch.Tensor, lp_partition: torch.Tensor, saved: torch.Tensor,
                    from_fp32_weights: bool) -> None:
        full = lp_partition.detach().to("cpu", _MASTER_DTYPE)   # the fp32 masters
        if from_fp32_weights:
            full = torch.zeros_like(full)
            full.narrow(0, 0, saved.numel()).copy_(saved)
        self._holder.load_master_partition(index, full)

    def held_state(self, masters: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [], []    # masters and optimizer state already live in OffloadStates

    def state_bytes(self, separate_masters: list[torch.Tensor]) -> dict[str, int]:
        offloaded = self._holder.memory_breakdown()
        return {"master_params": offloaded["master_params"], "optimizer_states": offloaded["optimizer_states"]}

    @property
    def _holder(self) -> OffloadStates:
        assert self.offload is not None
        return self.offload

    @property
    def _sink(self) -> HostGradientSink:
        assert self.sink is not None
        return self.sink


def build_group_placement(optimizer: torch.optim.Optimizer, zero_config: Any,
                          offload: OffloadStates | None) -> GroupPlacement:
    """The run's one placement decision at stages 1 and 2: the holder `offload` exists iff
    `offload_optimizer` is on."""
    if offload is None:
        return GroupPlacement(optimizer)
    return OffloadGroupPlacement(optimizer, offload, getattr(zero_config, "offload_optimizer", None))
