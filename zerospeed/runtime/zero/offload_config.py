"""DeepSpeed's import path for the offload config models (`deepspeed.runtime.zero.offload_config`).

Thin re-export: the models live in `offload/config.py` with the rest of ZeRO-Offload.
"""

from zerospeed.runtime.zero.offload.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
