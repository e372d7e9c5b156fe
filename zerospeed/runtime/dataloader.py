"""`DeepSpeedDataLoader`: the micro-batch loader over this rank's share of the data, and `RepeatingLoader`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class RepeatingLoader:
    """Wraps an iterable and restarts it when exhausted (DeepSpeed's name and behaviour)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    """Micro-batches of `batch_size` from a `DistributedSampler` over the data-parallel ranks."""

    def __init__(self, dataset: Any, batch_size: int, pin_memory: bool, local_rank: int,
                 tput_timer: Any = None, collate_fn: Callable[..., Any] | None = None,
                 num_local_io_workers: int | None = None, data_sampler: Any = None,
                 data_parallel_world_size: int = 1, data_parallel_rank: int = 0,
                 dataloader_drop_last: bool = False) -> None:
        self.tput_timer = tput_timer
        self.batch_size = batch_size
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size,
                                              rank=data_parallel_rank, shuffle=True)
        self.data_sampler = data_sampler
        self.dataloader = DataLoader(dataset, batch_size=batch_size, sampler=data_sampler,
                                     collate_fn=collate_fn, pin_memory=pin_memory and torch.cuda.is_available(),
                                     num_workers=num_local_io_workers or 0, drop_last=dataloader_drop_last)
        self.len = len(self.dataloader)
        self.epoch = 0
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> DeepSpeedDataLoader:
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        self._iterator = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            iter(self)
        if self.tput_timer is not None:
            self.tput_timer.start()
        return next(self._iterator)  # type: ignore[arg-type]
