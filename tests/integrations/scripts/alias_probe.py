"""Run with the alias first on PYTHONPATH: what a client library sees of `deepspeed` (one process,
so the test pays one start-up). Prints one JSON object."""

import importlib.metadata
import importlib.util
import json
import sys
import warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    spec_before = importlib.util.find_spec("deepspeed")
    import deepspeed
import zerospeed

out = {"spec_before": spec_before is not None, "is_zerospeed": deepspeed is zerospeed,
       "shadow_warning": [str(w.message) for w in caught if "hidden behind it" in str(w.message)],
       "dist_version": importlib.metadata.version("deepspeed"), "__version__": deepspeed.__version__,
       "metadata_name": importlib.metadata.metadata("deepspeed")["Name"]}

# Every deepspeed.X.Y is the module object zerospeed.X.Y: imported once, patches land on ours.
import deepspeed.runtime.engine  # noqa: E402 - after the alias import above, on purpose
import deepspeed.runtime.zero.partition_parameters as pp  # noqa: E402
import zerospeed.runtime.engine  # noqa: E402

out["same_engine_module"] = deepspeed.runtime.engine is zerospeed.runtime.engine
out["same_class"] = deepspeed.runtime.engine.DeepSpeedEngine is zerospeed.runtime.engine.DeepSpeedEngine
pp.zero_wrapper_for_fp_tensor_constructor = "patched"
out["patch_lands"] = sys.modules["zerospeed.runtime.zero.partition_parameters"].zero_wrapper_for_fp_tensor_constructor == "patched"
out["no_double_import"] = not [n for n, m in sys.modules.items() if n.startswith("deepspeed.")
                               and m is not sys.modules.get("zerospeed." + n[len("deepspeed."):])]

# Attribute chains after a bare import, and the symbols clients import (client-surface.md).
out["valid_lr_schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
symbols = {
    "deepspeed.utils": ["logger", "set_z3_leaf_modules", "safe_get_full_grad", "safe_get_full_fp32_param",
                        "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_get_local_fp32_param"],
    "deepspeed.utils.logging": ["logger"],
    "deepspeed.runtime.zero": ["Init", "GatheredParameters"],
    "deepspeed.runtime.zero.partition_parameters": ["ZeroParamStatus", "_orig_torch_arange", "get_accelerator"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME", "main"],
    "deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file",
                                     "get_optim_files"],
    "deepspeed.checkpointing": ["configure", "checkpoint"],
    "deepspeed.ops.adam": ["DeepSpeedCPUAdam"],
    "deepspeed.runtime.base_optimizer": ["DeepSpeedOptimizer"],
    "deepspeed.accelerator": ["get_accelerator"],
    "deepspeed.sequence.layer": ["DistributedAttention"],
    "deepspeed.runtime.sequence_parallel.ulysses_sp": ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP",
                                                       "sequence_tiled_compute", "TiledFusedLogitsLoss"],
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": ["initialize_sequence_parallel",
                                                              "get_sequence_parallel_group"],
    "deepspeed.inference.engine": ["InferenceEngine"],
    "deepspeed.inference.config": ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig"],
    "deepspeed.inference": ["DeepSpeedTPConfig"],
    "deepspeed": ["initialize", "init_distributed", "DeepSpeedEngine", "zero", "comm", "tp_model_init",
                  "init_inference", "InferenceEngine"],
}
out["missing"] = [f"{mod}.{name}" for mod, names in symbols.items() for name in names
                  if not hasattr(importlib.import_module(mod), name)]

# Features zerospeed does not have: the error names them.
errors = {}
try:
    deepspeed.tp_model_init(model=None, tp_size=2, dtype=None)
except TypeError as error:
    errors["tp_model_init"] = str(error)
try:
    import deepspeed.no_such_module  # noqa: F401
except ModuleNotFoundError as error:
    errors["unknown"] = str(error)
out["errors"] = errors
print(json.dumps(out))
