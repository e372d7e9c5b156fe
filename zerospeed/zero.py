"""`zerospeed.zero` (DeepSpeed's `deepspeed.zero`): build, gather and inspect ZeRO-3 parameters.

Thin re-exports; the concepts live in `zerospeed/runtime/zero/` (see docs/zero3.md).
"""

from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from zerospeed.runtime.zero.param_state import ZeroParamStatus, ZeroParamType
from zerospeed.runtime.zero.parameter_offload import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
)
from zerospeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from zerospeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

__all__ = [
    "DeepSpeedZeroConfig",
    "GatheredParameters",
    "Init",
    "ZeRoTraceMode",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroStageEnum",
    "get_z3_leaf_modules",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
]
