"""DeepSpeed's checkpoint key names (`deepspeed/checkpoint/constants.py`), so our files read like DeepSpeed's."""

from __future__ import annotations

__all__ = [
    "BUFFER_NAMES", "CLIENT_STATE_EXCLUDED_KEYS", "DP_WORLD_SIZE", "DS_CONFIG", "DS_VERSION",
    "FROZEN_PARAM_FRAGMENTS", "FROZEN_PARAM_SHAPES", "GLOBAL_SAMPLES", "GLOBAL_STEPS", "LR_SCHEDULER",
    "MODULE", "MP_WORLD_SIZE", "OPTIMIZER", "OPTIMIZER_STATE_DICT", "PARAM_SHAPES",
    "RESERVED_CLIENT_KEYS", "SHARED_PARAMS", "SKIPPED_STEPS", "ZERO_STAGE",
]

# model-states file
MODULE = "module"
BUFFER_NAMES = "buffer_names"
OPTIMIZER = "optimizer"
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
LR_SCHEDULER = "lr_scheduler"
DATA_SAMPLER = "data_sampler"
RANDOM_LTD = "random_ltd"
SPARSE_TENSOR_MODULE_NAMES = "sparse_tensor_module_names"
SKIPPED_STEPS = "skipped_steps"
GLOBAL_STEPS = "global_steps"
GLOBAL_SAMPLES = "global_samples"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"
CHECKPOINT_PARALLEL_DIMENSIONS = "checkpoint_parallel_dimensions"
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"

# optim-states file and the ZeRO optimizer state inside it
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
LOSS_SCALER = "loss_scaler"

# zerospeed's own key: how AutoTP cut each split parameter ([Note: AutoTP checkpoint layout])
TP_SHARDS_KEY = "autotp_shards"

# client_state = every top-level key of the model file except these
# (`deepspeed/runtime/engine.py::DeepSpeedEngine._load_checkpoint`)
CLIENT_STATE_EXCLUDED_KEYS = frozenset({
    MODULE, SPARSE_TENSOR_MODULE_NAMES, SKIPPED_STEPS, GLOBAL_STEPS, DP_WORLD_SIZE, MP_WORLD_SIZE,
    DATA_SAMPLER, RANDOM_LTD,
})
RESERVED_CLIENT_KEYS = frozenset({CHECKPOINT_PARALLEL_DIMENSIONS})
