"""Compat script: every config of tests/config_corpus through `runtime.config.DeepSpeedConfig`.

The parent fills ``"auto"`` as the HF Trainer does and passes the configs in; for each one this
reports the exception (type and message) or the values the engine derives from it, in a form
that is the same for both libraries (enums as their values, numbers as floats).
"""

from __future__ import annotations

import warnings
from typing import Any


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _device(zero_config: Any, section: str) -> str:
    offload = getattr(zero_config, section, None)
    device = getattr(offload, "device", None) if offload is not None else None
    return str(_enum_value(device)) if device is not None else "none"


def _precision(config: Any, name: str) -> bool:
    section = getattr(config, {"fp16": "float16_config", "bf16": "bfloat16_config"}[name], None)
    if section is None:
        section = getattr(config, name)
    return bool(section.enabled)


def _plain(value: Any) -> Any:
    """JSON-comparable: tuples as lists, ints as floats (1e-3 and 0.001, 2 and 2.0 compare equal)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(_enum_value(value))


def derived(config: Any) -> dict[str, Any]:
    zero = config.zero_config
    return _plain({
        "train_batch_size": config.train_batch_size,
        "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "zero_stage": int(config.zero_optimization_stage),
        "fp16": _precision(config, "fp16"),
        "bf16": _precision(config, "bf16"),
        "offload_optimizer": _device(zero, "offload_optimizer"),
        "offload_param": _device(zero, "offload_param"),
        "gradient_clipping": config.gradient_clipping,
        "optimizer": config.optimizer_name,
        "optimizer_params": config.optimizer_params,
        "scheduler": config.scheduler_name,
        "scheduler_params": config.scheduler_params,
    })


def main(ds, ctx, configs: dict[str, dict]) -> dict:
    config_module = ctx.submodule("runtime.config")
    result = {}
    for name, cfg in configs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                config = config_module.DeepSpeedConfig(cfg)
            except Exception as error:  # noqa: BLE001 - the type and message are the result
                result[name] = {"error": type(error).__name__, "message": str(error)[:800]}
                continue
        result[name] = {"error": None, "derived": derived(config),
                        "warnings": [str(w.message)[:300] for w in caught]}
    return result
