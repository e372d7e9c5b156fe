"""The monitor ds_config sections: ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet``.

Each is a top-level key of its own; `DeepSpeedMonitorConfig` groups the four for the monitor
master, and is `enabled` when any one of them is.
"""

from __future__ import annotations

from pydantic import Field

from zerospeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig"]


class TensorBoardConfig(DeepSpeedConfigModel):
    enabled: bool = False
    output_path: str = ""
    """Directory for event files ("" means the current directory's `runs/`)."""
    job_name: str = "DeepSpeedJobName"


class CSVConfig(DeepSpeedConfigModel):
    enabled: bool = False
    output_path: str = ""
    """Directory for the CSV files."""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(DeepSpeedConfigModel):
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(DeepSpeedConfigModel):
    enabled: bool = False
    samples_log_interval: int = Field(default=100, ge=1)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


class DeepSpeedMonitorConfig(DeepSpeedConfigModel):
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(block.enabled for block in (self.tensorboard, self.csv_monitor, self.wandb, self.comet))
