"""``zero_optimization.offload_param`` and ``zero_optimization.offload_optimizer``
(DeepSpeed's `deepspeed/runtime/zero/offload_config.py`).

With optimizer offload the optimizer step runs on the CPU whatever the device; ``nvme``
additionally swaps optimizer state to ``nvme_path`` (tuned by the top-level ``aio`` block).
Parameter offload is stage 3 only.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import Field, model_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The training states `engine.offload_states(include=...)` moves (runtime/zero/state_offload.py)."""

    optim_states = "optim_states"      # the base optimizer's state (Adam's moments)
    hp_params = "hp_params"            # the fp32 master partitions
    lp_params = "lp_params"            # the model's (low-precision) parameters and their flat buffers
    lp_grads = "lp_grads"              # the gradient accumulation buffers
    contiguous_grad_buffer = "contiguous_grad_buffer"   # reduction scratch buffers (contents not kept)


class _OffloadConfig(DeepSpeedConfigModel):
    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Where the offloaded tensors live: none, cpu or nvme."""
    nvme_path: Path | None = None
    """Directory for swap files; required when device is nvme."""
    pin_memory: bool = True
    """Page-lock the CPU buffers (faster host-device copies, more pinned RAM)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadConfig:
        if self.device == OffloadDeviceEnum.nvme and self.nvme_path is None:
            raise ValueError("device 'nvme' requires nvme_path")
        return self

    @property
    def enabled(self) -> bool:
        return self.device != OffloadDeviceEnum.none


class DeepSpeedZeroOffloadParamConfig(_OffloadConfig):
    buffer_count: int = Field(5, ge=0)
    """Number of parameter swap buffers (nvme)."""
    buffer_size: int = Field(100_000_000, ge=0)
    """Elements per parameter swap buffer (nvme)."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when offloading to nvme."""


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadConfig):
    buffer_count: int = Field(4, ge=0)
    """Number of optimizer-state swap buffers (nvme)."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group's state with the current step (nvme)."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group's state with the current step (nvme)."""
    fast_init: bool = False
    """Initialise optimizer state on nvme without staging through CPU."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of stage-3 sub-groups offloaded, the last ones (DeepSpeed's `int((1 - ratio) * N)`
    rule, docs/offload.md); < 1 is stage 3 only, the others stay on the accelerator."""
    super_offload: bool = False
    """SuperOffload (stage 3 CPU-GPU overlap)."""
    cpuadam_cores_perc: float = Field(0.8, gt=0.0, le=1.0)
    """Fraction of CPU cores used by the CPU optimizer."""

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write
