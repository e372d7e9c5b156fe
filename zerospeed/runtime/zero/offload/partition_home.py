"""Where stage 3's low-precision sub-group partitions (`lp_flat[k]`) live, by `offload_param`:
one of three homes, chosen once by `build_partition_home` ([Note: sub-group placement] in
offload/placement.py).

- `PartitionHome`: no `offload_param`; the partitions stay on the compute device where they were built.
- `HostPartitions`: `offload_param: cpu`; each partition is copied into host memory (pinned with
  an accelerator). Without optimizer offload the fp32 master and the optimizer state stay on the
  compute device ([Note: offload_param alone]): the master is a device copy of the partition.
- `NvmePartitions`: `offload_param: nvme`; as in host memory, then the sub-groups beyond the first
  `max_in_cpu` elements (cumulative, in sub-group order: DeepSpeed's rule) are written to swap
  files (`ParamSwapper`) and dropped from memory; a device master is written back to its file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine
from zerospeed.runtime.zero.offload.param_swapper import ParamSwapper
from zerospeed.runtime.zero.param_state import ZeroParameter, set_swapped

__all__ = ["HostPartitions", "NvmePartitions", "PartitionHome", "build_partition_home"]

DropFlat = Callable[[int, torch.Tensor], None]


class PartitionHome:
    """The partitions stay on the compute device; nothing is swapped."""

    def __init__(self) -> None:
        self.swapper: ParamSwapper | None = None
        self.swapped: dict[int, int] = {}      # sub-group -> its swap file (NvmePartitions)

    def place(self, lp: torch.Tensor) -> torch.Tensor:
        return lp

    def device_master(self, lp: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
        """The fp32 master of a sub-group kept on the device: the partition itself in fp32."""
        return lp if lp.dtype == torch.float32 else lp.float()

    def swap_out(self, lp_flat: list[torch.Tensor], groups: list[list[ZeroParameter]],
                 offset_of: Callable[[ZeroParameter], int], drop: DropFlat) -> None:
        """Move partitions to files and `drop(index, stand_in)` them from memory (only on NVMe)."""

    def write_back(self, index: int, master: torch.Tensor, lp: torch.Tensor) -> None:
        """The stepped device master of sub-group `index` into its partition."""
        if master.data_ptr() != lp.data_ptr():
            lp.copy_(master)

    def read_master(self, index: int, master: torch.Tensor, lp: torch.Tensor) -> None:
        """Sub-group `index`'s device master re-derived from its (just loaded) partition."""
        if master.data_ptr() != lp.data_ptr():
            master.copy_(lp)

    def close(self) -> None:
        """Wait for parameter I/O and remove the swap files (only on NVMe)."""


class HostPartitions(PartitionHome):
    """`offload_param: cpu`: the partitions in host memory, pinned when an accelerator is present."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block
        self._pin = bool(block.pin_memory) and torch.cuda.is_available()

    def place(self, lp: torch.Tensor) -> torch.Tensor:
        return torch.empty(lp.shape, dtype=lp.dtype, pin_memory=self._pin).copy_(lp)

    def device_master(self, lp: torch.Tensor, compute_device: torch.device) -> torch.Tensor:
        # [Note: offload_param alone] the master and the optimizer state stay on the compute
        # device (DeepSpeed's ZeRO-Infinity parameter offload); only `lp` lives on the host / NVMe.
        return lp.to(compute_device, torch.float32, copy=True)


class NvmePartitions(HostPartitions):
    """`offload_param: nvme`: host memory up to `max_in_cpu` elements, swap files beyond."""

    def __init__(self, block: Any, aio_config: Any) -> None:
        super().__init__(block)
        self.aio_config = aio_config

    def swap_out(self, lp_flat: list[torch.Tensor], groups: list[list[ZeroParameter]],
                 offset_of: Callable[[ZeroParameter], int], drop: DropFlat) -> None:
        block, aio = self.block, self.aio_config
        swap_dir = os.path.join(str(block.nvme_path), "zerospeed_offload",
                                f"rank{comm.get_rank():02d}_pid{os.getpid()}", "param")
        swapper = ParamSwapper(swap_dir, AsyncIOEngine(aio.block_size, aio.queue_depth, aio.intra_op_parallelism),
                               int(block.buffer_count) * int(block.buffer_size), bool(block.pin_memory))
        flat_ids: dict[int, int] = {}
        in_cpu = 0
        for index, (lp, params) in enumerate(zip(lp_flat, groups)):
            if in_cpu + lp.numel() <= int(block.max_in_cpu):
                in_cpu += lp.numel()
                continue
            flat_ids[index] = swapper.add_flat(lp)
            for param in params:
                set_swapped(param, swapper.partition(flat_ids[index], offset_of(param), param.partition_numel()))
            drop(index, torch.empty(0, dtype=lp.dtype))
        self.swapper, self.swapped = swapper, flat_ids

    def write_back(self, index: int, master: torch.Tensor, lp: torch.Tensor) -> None:
        if index not in self.swapped:
            super().write_back(index, master, lp)
            return
        self.swapper.write_range(self.swapped[index], 0, master.detach().to("cpu", lp.dtype), wait=True)  # type: ignore[union-attr]

    def read_master(self, index: int, master: torch.Tensor, lp: torch.Tensor) -> None:
        if index not in self.swapped:
            super().read_master(index, master, lp)
            return
        swapper = self.swapper
        assert swapper is not None
        values = torch.empty(master.numel(), dtype=swapper.dtype(self.swapped[index]))
        swapper.read_range(self.swapped[index], 0, values)
        master.copy_(values)

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()


def build_partition_home(block: Any, aio_config: Any) -> PartitionHome:
    """The home `offload_param` (None or disabled: the device) gives every sub-group's partition."""
    if block is None or not block.enabled:
        return PartitionHome()
    if block.device.value == "nvme":
        return NvmePartitions(block, aio_config)
    return HostPartitions(block)
