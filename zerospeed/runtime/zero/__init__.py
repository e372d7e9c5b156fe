"""ZeRO stages 1-3 (docs/zero.md, docs/zero3.md); offload in `offload/` (docs/offload.md).

DeepSpeed exports the zero.Init family and the stage-3 hook holder here too
(`deepspeed.runtime.zero.Init`, `deepspeed/runtime/zero/__init__.py`); they load on first access,
as do the submodules.
"""

from typing import Any

_EXPORTS = {
    "Init": "partition_parameters", "GatheredParameters": "partition_parameters",
    "register_external_parameter": "partition_parameters", "unregister_external_parameter": "partition_parameters",
    "ZeroParamStatus": "param_state", "ZeroParamType": "param_state",
    "DeepSpeedZeRoOffload": "parameter_offload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    import importlib

    from zerospeed.utils.lazy_modules import find_submodule

    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if find_submodule(__name__, name):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
