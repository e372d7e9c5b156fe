"""Weights & Biases backend: `wandb.init(project, group, entity=team)`, then `wandb.log` per event.

Set `WANDB_MODE=offline` (as the tests do) to write runs locally without an account.
"""

from __future__ import annotations

from typing import Any

from zerospeed.monitor.monitor import Event, Monitor

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        try:
            import wandb
        except ImportError as error:
            raise ImportError("the `wandb` monitor block is enabled but wandb is not installed: "
                              "`pip install wandb` or set wandb.enabled=false") from error
        self._wandb = wandb
        self.run = wandb.init(project=wandb_config.project, group=wandb_config.group, entity=wandb_config.team)

    def write_events(self, event_list: list[Event]) -> None:
        # One committed log call per step: wandb only folds a step into the summary on commit.
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in event_list:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self.run.log(by_step[step], step=step, commit=True)

    def close(self) -> None:
        self.run.finish()
