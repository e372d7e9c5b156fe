"""Compat script: the same ds_configs through `runtime.config.DeepSpeedConfig` on either library.

For each case it reports the exception type (or None) and, when the config loads, the value the
engine would use; the test asserts where zerospeed deliberately differs (docs/compatibility.md,
"Configuration").
"""

from __future__ import annotations

import math

BASE = {"train_batch_size": 8}
CASES = {
    "tbs_negative": {"train_batch_size": -2},
    "tbs_string": {"train_batch_size": "2"},
    "fp16_enabled_yes": {**BASE, "fp16": {"enabled": "yes"}},
    "overlap_comm_string": {**BASE, "zero_optimization": {"stage": 2, "overlap_comm": "true"}},
    "clipping_string": {**BASE, "gradient_clipping": "1.0"},
    "lr_string": {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
    "optimizer_without_type": {**BASE, "optimizer": {"params": {"lr": 1e-3}}},
    "steps_per_print_inf": {**BASE, "steps_per_print": math.inf},
    "dotted_key": {**BASE, "zero_optimization": {"stage": 3}, "zero_optimization.reduce_bucket_size": 1000},
    "msamp": {**BASE, "msamp": {"enabled": False}},
    "unknown_top": {**BASE, "my_client_flag": 1},
    "typo_top": {**BASE, "train_batch_sizes": 8},
    "unknown_nested": {**BASE, "zero_optimization": {"stage": 1, "brand_new_knob": 3}},
    "typo_nested": {**BASE, "zero_optimization": {"stage": 3, "stage3_prefech_bucket_size": 1}},
    "stage_string": {**BASE, "zero_optimization": {"stage": "2"}},
    "sub_group_size_zero": {**BASE, "zero_optimization": {"stage": 3, "sub_group_size": 0}},
    "triangle": {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
}


def _value(config, case: str):
    if case == "dotted_key":
        return int(config.zero_config.reduce_bucket_size)
    if case == "steps_per_print_inf":
        return str(config.steps_per_print)
    if case == "stage_string":
        return int(config.zero_optimization_stage)
    if case == "sub_group_size_zero":
        return int(config.zero_config.sub_group_size)
    if case == "overlap_comm_string":
        return bool(config.zero_config.overlap_comm)
    return None


def main(ds, ctx) -> dict:
    config_module = ctx.submodule("runtime.config")
    result = {}
    for case, cfg in CASES.items():
        try:
            config = config_module.DeepSpeedConfig(cfg)
        except Exception as error:  # noqa: BLE001 - the type is the result
            result[case] = {"error": type(error).__name__, "message": str(error)[:600]}
            continue
        result[case] = {"error": None, "value": _value(config, case)}
    return result
