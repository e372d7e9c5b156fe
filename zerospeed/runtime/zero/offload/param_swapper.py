"""`ParamSwapper`: ZeRO-3 parameter partitions on NVMe (`offload_param.device: nvme`).

A stage-3 sub-group's low-precision partitions (`lp_flat[k]` in stage3.py, every parameter's
`ds_tensor` a slice of it) are one file, `flat_<k>.swp`, byte for byte: a parameter's partition
is the byte range `[offset, offset + partition_numel) * element_size` of its sub-group's file
(`SwappedPartition`). While swapped, the parameter's `ds_tensor` is an empty stand-in; the bytes
are read when something needs them:

- a gather (`param_gather._gather_same_dtype`) reads each swapped partition straight into
  its slice of the gather's input buffer (`read_into`), taking a read-ahead copy if one is ready;
- the coordinator reads ahead along the trace (`prefetch`): partitions the next modules will
  gather are read into their own small tensors, at most `budget_numel` elements at a time
  (`buffer_count * buffer_size`), so RAM for read-ahead stays bounded;
- the optimizer step reads a range of the flat (`read_range`), updates it and writes it back
  (`write_range`, write-behind: the write is waited for before anything reads that file again).

A write drops the read-ahead copies of its file, so a stale copy is never used. Files live in a
private directory under `nvme_path`, removed by `close()`, at garbage collection or at exit.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import weakref
from concurrent.futures import Future

import torch

from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine

__all__ = ["ParamSwapper", "SwappedFlatAccess", "SwappedPartition"]


@dataclasses.dataclass(frozen=True)
class SwappedPartition:
    """Where one parameter's partition lives on disk: element `offset` of flat file `flat_id`."""

    swapper: ParamSwapper
    flat_id: int
    offset: int
    numel: int
    dtype: torch.dtype


@dataclasses.dataclass
class _ReadAhead:
    tensor: torch.Tensor
    future: Future


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class ParamSwapper:
    def __init__(self, swap_dir: str, aio: AsyncIOEngine, budget_numel: int, pin_memory: bool) -> None:
        os.makedirs(swap_dir, exist_ok=True)
        self.swap_dir = swap_dir
        self.aio = aio
        self.budget_numel = max(0, int(budget_numel))
        self.pin = pin_memory and torch.cuda.is_available()
        self._numel: dict[int, int] = {}
        self._dtype: dict[int, torch.dtype] = {}
        self._writes: dict[int, list[Future]] = {}
        self._ahead: dict[tuple[int, int], _ReadAhead] = {}   # (flat_id, offset) -> read-ahead copy
        self._lock = threading.Lock()
        self.ahead_numel = 0
        self.peak_ahead_numel = 0
        self._finalizer = weakref.finalize(self, _remove_dir, swap_dir)

    # --- files -------------------------------------------------------------------------------------
    def path(self, flat_id: int) -> str:
        return os.path.join(self.swap_dir, f"flat_{flat_id:06d}.swp")

    def add_flat(self, flat: torch.Tensor) -> int:
        """Write a new flat (a sub-group's partitions) to its file; returns its id."""
        flat_id = len(self._numel)
        self._numel[flat_id] = flat.numel()
        self._dtype[flat_id] = flat.dtype
        self.aio.write(self.path(flat_id), flat.detach().cpu().contiguous())
        return flat_id

    def partition(self, flat_id: int, offset: int, numel: int) -> SwappedPartition:
        return SwappedPartition(self, flat_id, offset, numel, self._dtype[flat_id])

    def dtype(self, flat_id: int) -> torch.dtype:
        return self._dtype[flat_id]

    def _byte_offset(self, flat_id: int, offset: int) -> int:
        return offset * torch.empty(0, dtype=self._dtype[flat_id]).element_size()

    def _wait_writes(self, flat_id: int) -> None:
        for future in self._writes.pop(flat_id, []):
            future.result()

    # --- reads -------------------------------------------------------------------------------------
    def read_into(self, part: SwappedPartition, out: torch.Tensor) -> None:
        """Fill `out` (a CPU tensor of `part.numel` elements) with the partition's bytes."""
        ahead = self._take_ahead(part)
        if ahead is not None:
            ahead.future.result()
            out.copy_(ahead.tensor)
            return
        self.read_range(part.flat_id, part.offset, out)

    def read_range(self, flat_id: int, offset: int, out: torch.Tensor) -> None:
        self._wait_writes(flat_id)
        self.aio.read(self.path(flat_id), out, self._byte_offset(flat_id, offset))

    def prefetch(self, part: SwappedPartition) -> bool:
        """Start reading `part` ahead if the budget allows; False when it is full (never blocks)."""
        key = (part.flat_id, part.offset)
        with self._lock:
            if key in self._ahead:
                return True
            if self.ahead_numel + part.numel > self.budget_numel:
                return False
            self.ahead_numel += part.numel
            self.peak_ahead_numel = max(self.peak_ahead_numel, self.ahead_numel)
        self._wait_writes(part.flat_id)
        tensor = torch.empty(part.numel, dtype=part.dtype, pin_memory=self.pin)
        future = self.aio.submit_read(self.path(part.flat_id), tensor, self._byte_offset(part.flat_id, part.offset))
        with self._lock:
            self._ahead[key] = _ReadAhead(tensor, future)
        return True

    def _take_ahead(self, part: SwappedPartition) -> _ReadAhead | None:
        with self._lock:
            ahead = self._ahead.pop((part.flat_id, part.offset), None)
            if ahead is not None:
                self.ahead_numel -= part.numel
        return ahead

    def drop_read_ahead(self, flat_id: int | None = None) -> None:
        """Forget read-ahead copies (of one file, or all): they may be stale after a write."""
        with self._lock:
            keys = [k for k in self._ahead if flat_id is None or k[0] == flat_id]
            dropped = [(k, self._ahead.pop(k)) for k in keys]
        for _key, ahead in dropped:
            ahead.future.result()
            with self._lock:
                self.ahead_numel -= ahead.tensor.numel()

    # --- writes ------------------------------------------------------------------------------------
    def write_range(self, flat_id: int, offset: int, source: torch.Tensor, wait: bool = False) -> None:
        """Write `source` at element `offset` of the flat; behind the caller's back unless `wait`.
        `source` must not change until `flush()` (or the next read of this file) returns."""
        self.drop_read_ahead(flat_id)
        future = self.aio.submit_write(self.path(flat_id), source, self._byte_offset(flat_id, offset))
        self._writes.setdefault(flat_id, []).append(future)
        if wait:
            self._wait_writes(flat_id)

    def flush(self) -> None:
        for flat_id in list(self._writes):
            self._wait_writes(flat_id)

    # --- accounting / cleanup ------------------------------------------------------------------------
    def file_bytes(self) -> int:
        return sum(os.path.getsize(self.path(i)) for i in self._numel if os.path.exists(self.path(i)))

    @property
    def total_numel(self) -> int:
        return sum(self._numel.values())

    def close(self) -> None:
        self.drop_read_ahead()
        self.flush()
        self.aio.shutdown()
        self._finalizer()


class SwappedFlatAccess:
    """`OffloadStates`' way to the stage-3 low-precision flats when some live on NVMe: flat
    `index` is read from / written to its file if it was swapped (`flat_ids`), else it is the
    resident tensor (the same interface as offload_states.ResidentPartitions)."""

    def __init__(self, swapper: ParamSwapper, partitions: list[torch.Tensor], flat_ids: dict[int, int]) -> None:
        self.swapper = swapper
        self.partitions = partitions
        self.flat_ids = flat_ids

    def view(self, index: int, offset: int, numel: int, read: bool = True) -> torch.Tensor:
        flat_id = self.flat_ids.get(index)
        if flat_id is None:
            return self.partitions[index].narrow(0, offset, numel)
        values = torch.empty(numel, dtype=self.swapper.dtype(flat_id), pin_memory=self.swapper.pin)
        if read:
            self.swapper.read_range(flat_id, offset, values)
        return values

    def commit(self, index: int, offset: int, values: torch.Tensor) -> None:
        flat_id = self.flat_ids.get(index)
        if flat_id is not None:
            self.swapper.write_range(flat_id, offset, values)
