"""`UlyssesSPDataLoaderAdapter`: each sequence-parallel group trains on one sample at a time.

Every rank's DataLoader yields its own batch. On refill the adapter gathers the ``sp`` batches of
the group, shifts each batch's ``labels`` on the full sequence into ``shift_labels`` (so a slice's
last token is scored against the next slice's first token, and the loss needs no neighbour), and
hands rank ``r`` slice ``r`` of batch 0, then of batch 1, ... So ``sp`` consecutive micro-steps
of the group cover the ``sp`` batches its ranks loaded, each computed by all of them together.
Batches may differ in length between ranks (they are padded for the gather and trimmed after);
each length must be divisible by ``sp``. ``position_ids`` are required: after sharding they are
what tells attention the global position of each token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed import comm

__all__ = ["UlyssesSPDataLoaderAdapter"]


class UlyssesSPDataLoaderAdapter:
    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts from a fresh iterator
            raise
        if "position_ids" not in batch:
            raise ValueError("UlyssesSPDataLoaderAdapter: every batch needs `position_ids` (torch.arange(seq_len) "
                             "per sample, or resetting at document boundaries for packed samples); after "
                             "sharding they carry each token's global position")
        gathered: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        lengths = self._gather_lengths(batch["input_ids"].shape[1])
        for key, value in batch.items():
            values = self._gather_tensor(key, value, lengths) if torch.is_tensor(value) else self._gather_object(value)
            for rank, item in enumerate(values):
                gathered[rank][key] = item
        for sample in gathered:
            self.micro_batches.append(self._shard(sample))

    def _gather_lengths(self, length: int) -> list[int]:
        mine = torch.tensor([length], dtype=torch.int64)
        lengths = torch.zeros(self.sp_world_size, dtype=torch.int64)
        comm.all_gather_into_tensor(lengths, mine, group=self.sp_group)  # one int per rank
        return lengths.tolist()

    def _gather_tensor(self, key: str, value: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        if value.dim() < 2 or value.shape[1] != lengths[self.sp_rank]:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: {key!r} has shape {tuple(value.shape)}; every tensor "
                             f"must be [batch, seq_len={lengths[self.sp_rank]}, ...] like input_ids")
        # Pad to the longest so one fixed-size gather serves every backend; trim after.
        longest = max(lengths)
        padded = torch.zeros((value.shape[0], longest, *value.shape[2:]), dtype=value.dtype)
        padded[:, :value.shape[1]] = value.cpu()
        out = padded.new_empty((self.sp_world_size, *padded.shape))
        comm.all_gather_into_tensor(out.view(-1), padded.view(-1), group=self.sp_group)
        return [out[rank, :, :lengths[rank]] for rank in range(self.sp_world_size)]

    def _gather_object(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.sp_world_size
        torch.distributed.all_gather_object(values, value, group=self.sp_group)
        return values

    def _shard(self, sample: dict[str, Any]) -> dict[str, Any]:
        length = sample["input_ids"].shape[1]
        if length % self.sp_world_size != 0:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sequence length {length} is not divisible by the "
                             f"sequence parallel size {self.sp_world_size}; pad the batch to a multiple")
        if "labels" in sample:  # shifted on the whole sequence, before slicing
            labels = sample.pop("labels")
            sample["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        chunk = length // self.sp_world_size
        cols = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        return {key: value[:, cols].contiguous().to(self.device) if torch.is_tensor(value) else value
                for key, value in sample.items()}
