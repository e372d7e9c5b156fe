"""ZeRO stages 1-3 (docs/zero.md, docs/zero3.md). DeepSpeed exports the zero.Init family here too
(`deepspeed.runtime.zero.Init`); they load on first access, as do the submodules."""

from typing import Any

_EXPORTS = {
    "Init": "partition_parameters", "GatheredParameters": "partition_parameters",
    "register_external_parameter": "partition_parameters", "unregister_external_parameter": "partition_parameters",
    "ZeroParamStatus": "param_state", "ZeroParamType": "param_state",
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
