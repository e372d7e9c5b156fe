"""`deepspeed.utils`: the logger, ZeRO-3 leaf modules, the `safe_get_*` / `safe_set_*` accessors of
full and local fp32 parameters, gradients and optimizer states. Loaded on first access so that
`import zerospeed` stays cheap."""

from typing import Any

from zerospeed.utils.logging import log_dist, logger

_EXPORTS = {
    **{name: "zerospeed.utils.z3_leaf_module" for name in (
        "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
        "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")},
    "is_initialized": "zerospeed.comm",
    "RepeatingLoader": "zerospeed.runtime.dataloader",
    **{name: "zerospeed.utils.tensor_fragment" for name in (
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_full_grad",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state")},
}

__all__ = ["log_dist", "logger", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    import importlib

    from zerospeed.utils.lazy_modules import find_submodule

    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if find_submodule(__name__, name):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
