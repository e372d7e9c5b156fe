"""How a checkpointed function's tensor inputs are kept between its forward and its recompute.

Only the inputs are kept (activations inside the function are rebuilt). Three forms, chosen per
tensor by `StoredInput.keep`:

* as is (`save_for_backward`, so an in-place change before backward is caught by autograd);
* partitioned (`partition_activations` with a model-parallel group of size > 1): this rank keeps
  only its 1/mp slice of the flattened tensor, padded so any size splits (DeepSpeed asserts
  divisibility), and the full tensor is all-gathered over the group before the recompute;
* on the host (`checkpoint_in_cpu`): a CPU copy, moved back to the tensor's device for the
  recompute. With partitioning it is the slice that goes to the host, as in DeepSpeed; without it,
  the whole tensor (DeepSpeed 0.19.8 does the same).

Integer tensors (token ids, masks) and tensors marked `no_checkpointing = True` are always kept
as is: they are small and may not be all-gathered as floats.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm

__all__ = ["PartitionGroup", "StoredInput"]


@dataclasses.dataclass(frozen=True)
class PartitionGroup:
    """The model-parallel group activations are partitioned across."""

    rank: int = 0
    size: int = 1
    group: Any = None


def _is_partitionable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not getattr(tensor, "no_checkpointing", False)


@dataclasses.dataclass
class StoredInput:
    """One tensor input: either kept itself (`index` into ctx.saved_tensors) or as a stored copy."""

    shape: torch.Size
    device: torch.device
    dtype: torch.dtype
    saved_index: int | None = None
    copy: torch.Tensor | None = None
    partitioned: bool = False
    numel: int = 0

    @classmethod
    def keep(cls, tensor: torch.Tensor, saved: list[torch.Tensor], partition: PartitionGroup | None,
             to_cpu: bool) -> StoredInput:
        stored = cls(tensor.shape, tensor.device, tensor.dtype, numel=tensor.numel())
        if partition is not None and partition.size > 1 and _is_partitionable(tensor):
            stored.copy = _slice_of(tensor.detach(), partition)
            stored.partitioned = True
        elif to_cpu and _is_partitionable(tensor):
            stored.copy = tensor.detach().to("cpu", copy=True)
        if stored.copy is None:
            stored.saved_index = len(saved)
            saved.append(tensor)
        elif to_cpu:
            stored.copy = stored.copy.to("cpu")
        return stored

    def restore(self, saved_tensors: tuple[torch.Tensor, ...], partition: PartitionGroup | None) -> torch.Tensor:
        if self.saved_index is not None:
            return saved_tensors[self.saved_index]
        assert self.copy is not None
        if not self.partitioned:
            return self.copy.to(self.device)
        assert partition is not None
        return _gather(self.copy.to(self.device), partition, self.numel).view(self.shape)


def _slice_of(tensor: torch.Tensor, partition: PartitionGroup) -> torch.Tensor:
    flat = tensor.contiguous().view(-1)
    slice_numel = -(-flat.numel() // partition.size)
    padded = torch.nn.functional.pad(flat, (0, slice_numel * partition.size - flat.numel()))
    return padded.narrow(0, slice_numel * partition.rank, slice_numel).clone()


def _gather(part: torch.Tensor, partition: PartitionGroup, numel: int) -> torch.Tensor:
    full = torch.empty(part.numel() * partition.size, dtype=part.dtype, device=part.device)
    comm.all_gather_into_tensor(full, part.contiguous(), group=partition.group)
    return full[:numel]
