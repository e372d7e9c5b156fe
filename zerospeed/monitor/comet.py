"""Comet backend: one `comet_ml` experiment; a tag is logged at most once per `samples_log_interval`.

The interval is counted in the events' step unit (samples, in the engine), per tag.
"""

from __future__ import annotations

from typing import Any

from zerospeed.monitor.monitor import Event, Monitor

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config)
        try:
            import comet_ml
        except ImportError as error:
            raise ImportError("the `comet` monitor block is enabled but comet_ml is not installed: "
                              "`pip install comet_ml` or set comet.enabled=false") from error
        self.samples_log_interval = int(comet_config.samples_log_interval)
        self._last_logged_step: dict[str, int] = {}
        settings = {key: getattr(comet_config, key) for key in
                    ("project", "workspace", "api_key", "experiment_key", "online", "mode")
                    if getattr(comet_config, key, None) is not None}
        self.experiment = comet_ml.start(**settings)
        if comet_config.experiment_name is not None:
            self.experiment.set_name(comet_config.experiment_name)

    def write_events(self, event_list: list[Event]) -> None:
        for tag, value, step in event_list:
            last = self._last_logged_step.get(tag)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self.experiment.log_metric(tag, value, step=step)
            self._last_logged_step[tag] = step

    def close(self) -> None:
        self.experiment.end()
