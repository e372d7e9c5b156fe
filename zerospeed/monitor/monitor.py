"""Monitors: training events fanned out to TensorBoard, CSV files, Weights & Biases and Comet.

An event is a `(tag, value, step)` tuple; the engine uses DeepSpeed's tags
(`Train/Samples/train_loss`, `Train/Samples/lr`, ...) with `step = global_samples`.
`MonitorMaster` builds one writer per enabled backend, on global rank 0 only, so every rank can
call `write_events` unconditionally; on the other ranks it does nothing. Each backend is one small
class behind `Monitor`, in its own file, imported only when its block is enabled so a missing
optional package fails with a message naming the package and the config key.
"""

from __future__ import annotations

import abc
from typing import Any

from zerospeed.utils.logging import logger

__all__ = ["Event", "Monitor", "MonitorMaster", "is_rank_zero", "log_dir_for"]

Event = tuple[str, float, int]


class Monitor(abc.ABC):
    """One backend: writes a list of `(tag, value, step)` events."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.enabled = bool(getattr(config, "enabled", False))

    @abc.abstractmethod
    def write_events(self, event_list: list[Event]) -> None: ...

    def close(self) -> None:
        """Flush and release the backend (the default has nothing to release)."""


def is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def log_dir_for(config: Any) -> str:
    """`<output_path>/<job_name>`; an empty output_path gives a relative `<job_name>` directory."""
    import os

    return os.path.join(config.output_path or "", config.job_name)


def _build_writers(monitor_config: Any) -> list[Monitor]:
    writers: list[Monitor] = []
    if monitor_config.tensorboard.enabled:
        from zerospeed.monitor.tensorboard import TensorBoardMonitor

        writers.append(TensorBoardMonitor(monitor_config.tensorboard))
    if monitor_config.wandb.enabled:
        from zerospeed.monitor.wandb import WandbMonitor

        writers.append(WandbMonitor(monitor_config.wandb))
    if monitor_config.csv_monitor.enabled:
        from zerospeed.monitor.csv_monitor import csvMonitor

        writers.append(csvMonitor(monitor_config.csv_monitor))
    if monitor_config.comet.enabled:
        from zerospeed.monitor.comet import CometMonitor

        writers.append(CometMonitor(monitor_config.comet))
    return writers


class MonitorMaster(Monitor):
    """All enabled backends (DeepSpeed's name). `enabled` is true when any block is enabled."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.enabled = bool(monitor_config.enabled)
        self.writers: list[Monitor] = _build_writers(monitor_config) if self.enabled and is_rank_zero() else []
        if self.writers:
            logger.info("Monitors: %s", ", ".join(type(w).__name__ for w in self.writers))

    def write_events(self, event_list: list[Event]) -> None:
        for writer in self.writers:
            writer.write_events(event_list)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
