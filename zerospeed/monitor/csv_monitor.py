"""CSV backend, in DeepSpeed's layout (`deepspeed/monitor/csv_monitor.py::csvMonitor.write_events`).

One file per tag under `<output_path>/<job_name>/`, named after the tag with `/` and spaces
replaced by `_` (`Train/Samples/lr` -> `Train_Samples_lr.csv`). A new file starts with the header
`step,<last tag component>`; each event appends a `step,value` row.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from zerospeed.monitor.monitor import Event, Monitor, log_dir_for

__all__ = ["csvMonitor", "csv_file_name"]


def csv_file_name(tag: str) -> str:
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's class name
    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.log_dir = log_dir_for(csv_config)
        os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, event_list: list[Event]) -> None:
        for tag, value, step in event_list:
            path = os.path.join(self.log_dir, csv_file_name(tag))
            new_file = not os.path.exists(path)
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new_file:
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, _plain(value)])


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
