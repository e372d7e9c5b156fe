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
    # client and tutorial keys DeepSpeed ignores that are near-misses of real keys
    "comms_config": {**BASE, "comms_config": {"verbose": False}},
    "comment_key": {**BASE, "_comment": "zero2 with AutoTP"},
    "data_parallel_size": {**BASE, "data_parallel_size": 1},
}
# Sections DeepSpeed removed: DeepSpeed 0.19.8 refuses each whenever it is present, even disabled.
REMOVED_SECTIONS = {
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
    "progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.001},
    "sparse_attention": {"mode": "fixed", "block": 16},
    "elasticity": {"enabled": False, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]},
    "amp": {"enabled": False},
    "nebula": {"enabled": False},
    "quantize_training": {"enabled": False},
    "sparse_gradients": False,
    "eigenvalue": {"enabled": False},
    "graph_harvesting": False,
    "curriculum_learning": {"enabled": False},
}
REMOVED_ZERO_KEYS = {"mics_shard_size": -1, "mics_hierarchical_params_gather": False, "zeropp_loco_param": {}}
# Sections DeepSpeed 0.19.8 implements and zerospeed does not: live (zerospeed refuses) or inert.
UNIMPLEMENTED_CASES = {
    "torch_autocast_on": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "torch_autocast_off": {"torch_autocast": {"enabled": False}},
    "deepcompile_on": {"compile": {"deepcompile": True}},
    "deepcompile_off": {"compile": {"deepcompile": False}},
    "data_efficiency_on": {"data_efficiency": {"enabled": True}},
    "data_efficiency_off": {"data_efficiency": {"enabled": False}},
    "autoep_on": {"expert_parallel": {"enabled": True, "autoep_size": 1}},
    "zenflow": {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}},
    "hybrid_engine": {"hybrid_engine": {"enabled": True}},
    "autotuning": {"autotuning": {"enabled": True}},
}
CASES.update({f"removed_{key}": {**BASE, key: value} for key, value in REMOVED_SECTIONS.items()})
CASES.update({f"removed_zero_{key}": {**BASE, "zero_optimization": {"stage": 3, key: value}}
              for key, value in REMOVED_ZERO_KEYS.items()})
CASES.update({case: {**BASE, **extra} for case, extra in UNIMPLEMENTED_CASES.items()})


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


# The four sections issue 31 names, also through `initialize` (where a user meets the refusal).
INITIALIZE_SECTIONS = ("compression_training", "progressive_layer_drop", "sparse_attention", "elasticity")


def _initialize_refusals(ds) -> dict:
    import torch

    result = {}
    for key in INITIALIZE_SECTIONS:
        model = torch.nn.Linear(4, 4)
        try:
            ds.initialize(model=model, model_parameters=model.parameters(),
                          config={**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, key: REMOVED_SECTIONS[key]})
        except Exception as error:  # noqa: BLE001 - the type and message are the result
            result[f"initialize_{key}"] = {"error": type(error).__name__, "message": str(error)[:600]}
            continue
        result[f"initialize_{key}"] = {"error": None, "value": None}
    return result


def main(ds, ctx) -> dict:
    config_module = ctx.submodule("runtime.config")
    result = _initialize_refusals(ds)
    for case, cfg in CASES.items():
        try:
            config = config_module.DeepSpeedConfig(cfg)
        except Exception as error:  # noqa: BLE001 - the type is the result
            result[case] = {"error": type(error).__name__, "message": str(error)[:600]}
            continue
        result[case] = {"error": None, "value": _value(config, case)}
    return result
