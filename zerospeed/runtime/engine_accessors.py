"""DeepSpeed's one-line engine accessors, kept out of engine.py so that file holds behaviour only.

Clients call them for the config they run under (Megatron-DeepSpeed, accelerate and user code ask
`engine.zero_reduce_bucket_size()` and the like); tests/compat/test_engine_surface.py compares
their values with DeepSpeed 0.19.8's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.tensor_parallel.config import TPTrainingConfig
from zerospeed.runtime.engine_moe import EngineMoE
from zerospeed.runtime.tensor_parallel.engine_component import EngineTensorParallel


def _zero_key(key: str) -> Callable[[Any], Any]:
    """An accessor returning `zero_optimization.<key>` (DeepSpeed's `zero_*()` getters, one a key)."""

    def accessor(self: Any) -> Any:
        return getattr(self._config.zero_config, key)

    accessor.__doc__ = f"`zero_optimization.{key}` of the ds_config."
    return accessor


def _flops_profiler_key(key: str) -> Callable[[Any], Any]:
    """An accessor returning `flops_profiler.<key>` (autotuning, which could override some, is not implemented)."""

    def accessor(self: Any) -> Any:
        return getattr(self._config.flops_profiler_config, key)

    accessor.__doc__ = f"`flops_profiler.{key}` of the ds_config."
    return accessor


class EngineAccessors:
    _config: Any
    optimizer: Any
    basic_optimizer: Any
    client_optimizer: Any
    precision: Any                      # PrecisionSettings
    communication_data_type: torch.dtype
    _global_grad_norm: float | None
    _step_applied: bool
    tensor_parallel: EngineTensorParallel
    moe: EngineMoE
    dp_group: Any

    # --- batch sizes ----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    # --- config ---------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_optimization_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_optimization_stage >= 3

    def fp16_enabled(self) -> bool:
        return self._config.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16_enabled

    bf16_enabled = bfloat16_enabled

    def fp16_auto_cast(self) -> bool:
        return bool(self._config.fp16.auto_cast)

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16_enabled and self._config.loss_scale == 0

    def loss_scale(self) -> float:
        return self._config.loss_scale

    def communication_data_type_name(self) -> str:
        return str(self.communication_data_type)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        return self.precision.param_dtype, self.precision.grad_accum_dtype

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    def optimizer_name(self) -> str | None:
        """DeepSpeed's: the class name of the client's `optimizer=` as given (so "function" for a callable
        that builds one), else the config's optimizer type."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return self._config.optimizer_name

    def optimizer_params(self) -> dict[str, Any] | None:
        return self._config.optimizer_params

    def optimizer_legacy_fusion(self) -> bool:
        return self._config.optimizer_legacy_fusion

    def scheduler_name(self) -> str | None:
        return self._config.scheduler_name

    def scheduler_params(self) -> dict[str, Any] | None:
        return self._config.scheduler_params

    def initial_dynamic_scale(self) -> float:
        return self._config.initial_dynamic_scale

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The fp16 section's dynamic-scaler arguments, fp16 on or off (DeepSpeed's; the engine itself
        reads `_config.dynamic_loss_scale_args`, None unless dynamic fp16 scaling is on)."""
        fp16 = self._config.fp16
        return {"init_scale": 2**fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def fp16_master_weights_and_gradients(self) -> bool:
        return self._config.fp16_master_weights_and_gradients

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self._config.bf16.bf16_optimizer_states

    def dump_state(self) -> bool:
        return self._config.dump_state

    def managed_gradient_accumulation(self) -> bool:
        return self._config.managed_gradient_accumulation

    def aio_config(self) -> Any:
        return self._config.aio_config

    # --- checkpoint -------------------------------------------------------------------------------
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint_tag_validation_mode != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint_tag_validation_mode == "Fail"

    def checkpoint_serialization_enabled(self) -> bool:
        return self._config.checkpoint_config.checkpoint_serialization

    def checkpoint_writer_enabled(self) -> bool:
        return self._config.checkpoint_config.writer is not None

    def load_universal_checkpoint(self) -> bool:
        return self._config.load_universal_checkpoint

    def use_node_local_storage(self) -> bool:
        return self._config.use_node_local_storage

    # --- zero_optimization ------------------------------------------------------------------------
    zero_allgather_bucket_size = _zero_key("allgather_bucket_size")
    zero_allgather_partitions = _zero_key("allgather_partitions")
    zero_allgather_sequential = _zero_key("allgather_sequential")
    zero_compute_grad_norm = _zero_key("compute_grad_norm")
    zero_contiguous_gradients = _zero_key("contiguous_gradients")
    zero_elastic_checkpoint = _zero_key("elastic_checkpoint")
    zero_hpz_partition_size = _zero_key("zero_hpz_partition_size")
    zero_ignore_unused_parameters = _zero_key("ignore_unused_parameters")
    zero_legacy_stage1 = _zero_key("legacy_stage1")
    zero_load_from_fp32_weights = _zero_key("load_from_fp32_weights")
    zero_log_trace_cache_warnings = _zero_key("log_trace_cache_warnings")
    zero_max_live_parameters = _zero_key("max_live_parameters")
    zero_max_reuse_distance = _zero_key("max_reuse_distance")
    zero_model_persistence_threshold = _zero_key("model_persistence_threshold")
    zero_module_granularity_threshold = _zero_key("module_granularity_threshold")
    zero_multi_rank_bucket_allreduce = _zero_key("use_multi_rank_bucket_allreduce")
    zero_offload_optimizer = _zero_key("offload_optimizer")
    zero_offload_param = _zero_key("offload_param")
    zero_overlap_comm = _zero_key("overlap_comm")
    zero_param_persistence_threshold = _zero_key("param_persistence_threshold")
    zero_parameter_alignment = _zero_key("parameter_alignment")
    zero_quantized_gradients = _zero_key("zero_quantized_gradients")
    zero_quantized_nontrainable_weights = _zero_key("zero_quantized_nontrainable_weights")
    zero_quantized_weights = _zero_key("zero_quantized_weights")
    zero_reduce_bucket_size = _zero_key("reduce_bucket_size")
    zero_reduce_scatter = _zero_key("reduce_scatter")
    zero_round_robin_gradients = _zero_key("round_robin_gradients")
    zero_save_muon_momentum_buffer_in_memory = _zero_key("save_muon_momentum_buffer_in_memory")
    zero_sub_group_size = _zero_key("sub_group_size")
    zenflow_config = _zero_key("zenflow")
    is_sanity_checks_enabled = _zero_key("enable_sanity_checks")

    def zero_prefetch_bucket_size(self) -> int:
        """1 under stage3_allgather_sequential at stage 3, what the prefetcher then uses (DeepSpeed
        rewrites the key so); else the key."""
        zero = self._config.zero_config
        sequential = zero.allgather_sequential and self.zero_optimization_partition_weights()
        return 1 if sequential else zero.prefetch_bucket_size

    def zero_cpu_offload(self) -> bool:
        return self._config.zero_config.offload_optimizer_device.value == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self._config.zero_config.offload_optimizer_device.value in ("cpu", "nvme")

    def zero_partial_offload(self) -> float:
        return getattr(self._config.zero_config.offload_optimizer, "ratio", 1.0)

    def super_offload(self) -> bool:
        return getattr(self._config.zero_config.offload_optimizer, "super_offload", False)

    def cpuadam_cores_perc(self) -> float:
        return getattr(self._config.zero_config.offload_optimizer, "cpuadam_cores_perc", 0.9)  # DeepSpeed's fallback

    def zero_nvme_offload_optimizer(self) -> bool:
        return getattr(self.optimizer, "swap_optimizer", False)

    # --- flops_profiler -----------------------------------------------------------------------------
    flops_profiler_enabled = _flops_profiler_key("enabled")
    flops_profiler_profile_step = _flops_profiler_key("profile_step")
    flops_profiler_module_depth = _flops_profiler_key("module_depth")
    flops_profiler_top_modules = _flops_profiler_key("top_modules")
    flops_profiler_detailed = _flops_profiler_key("detailed")
    flops_profiler_output_file = _flops_profiler_key("output_file")
    flops_profiler_recompute_fwd_factor = _flops_profiler_key("recompute_fwd_factor")

    # --- optimizer state --------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_loss_scale(self) -> float:
        return self.optimizer.cur_scale

    # --- Mixture of Experts (engine_moe.py: the `moe` component) ----------------------------------
    @property
    def has_moe_layers(self) -> bool:
        return self.moe.has_moe_layers

    @property
    def num_experts(self) -> list[int]:
        return self.moe.num_experts

    @property
    def moe_layers(self) -> list[Any]:
        return self.moe.moe_layers

    @property
    def gate_modules(self) -> list[Any]:
        return self.moe.gate_modules

    # --- tensor parallelism (tensor_parallel/engine_component.py) ---------------------------------
    def autotp_size(self) -> int:
        return self._config.tensor_parallel_config.autotp_size

    def tensor_parallel_config(self) -> TPTrainingConfig:
        return self._config.tensor_parallel_config

    def get_tensor_parallel_rank(self) -> int:
        return self.tensor_parallel.tp_rank

    def get_model_parallel_rank(self) -> int:
        return self.tensor_parallel.tp_rank

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank(self.dp_group)

    @property
    def mp_world_size(self) -> int:
        return self.tensor_parallel.tp_size

    # --- sequence parallelism -------------------------------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        """The Ulysses group (DeepSpeed's attribute is only set with sequence_parallel_size > 1)."""
        return self.seq_parallel_group  # type: ignore[attr-defined]
