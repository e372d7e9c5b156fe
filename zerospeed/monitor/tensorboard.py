"""TensorBoard backend: `SummaryWriter(log_dir=<output_path>/<job_name>)`, one scalar per event."""

from __future__ import annotations

from typing import Any

from zerospeed.monitor.monitor import Event, Monitor, log_dir_for

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(tensorboard_config)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("the `tensorboard` monitor block is enabled but the tensorboard package is "
                              "not installed: `pip install tensorboard` or set tensorboard.enabled=false") from error
        self.log_dir = log_dir_for(tensorboard_config)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: list[Event], flush: bool = True) -> None:
        for tag, value, step in event_list:
            self.summary_writer.add_scalar(tag, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
