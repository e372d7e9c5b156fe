"""The ds_config as the engine reads it: `DeepSpeedConfig` (DeepSpeed's class and import path).

A config arrives as a dict, a path to a JSON/HJSON file, or urlsafe-base64 JSON (config_loading).
It is validated once, as `DeepSpeedRootConfig` (config_root), whose fields are the top-level keys
with DeepSpeed's defaults and one model per section. The batch triangle is resolved in one place
(config_batch). `DeepSpeedConfig` is the flat view the engine reads: the resolved batch sizes plus
DeepSpeed's attribute names. Rules for unknown keys, ``"auto"`` and strings are in config_utils and
docs/config.md.
"""

from __future__ import annotations

import json
from typing import Any

from zerospeed.monitor.config import DeepSpeedMonitorConfig
from zerospeed.runtime.config_batch import data_parallel_world_size, resolve_batch_sizes
from zerospeed.runtime.config_loading import auto_key_paths, load_ds_config
from zerospeed.runtime.config_optimizer import DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS
from zerospeed.runtime.config_root import UNIMPLEMENTED_KEYS, DeepSpeedRootConfig
from zerospeed.runtime.config_sections import AioConfig
from zerospeed.runtime.config_keys import validate_section
from zerospeed.runtime.config_utils import ConfigError
from zerospeed.utils.logging import logger

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "UNIMPLEMENTED_KEYS",
    "AioConfig",
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedRootConfig",
    "load_ds_config",
    "resolve_batch_sizes",
]


class DeepSpeedConfig:
    """The validated ds_config with the batch triangle resolved, under DeepSpeed's attribute names."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None, world_size: int | None = None):
        self._param_dict = load_ds_config(config)
        self.resolved_auto_keys = auto_key_paths(self._param_dict)
        self.model = validate_section(DeepSpeedRootConfig, self._param_dict)
        self.world_size, self.world_size_source = data_parallel_world_size(
            world_size, mpu, mesh_device, self.model.sequence_parallel_size)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            resolve_batch_sizes(self.model.train_batch_size, self.model.train_micro_batch_size_per_gpu,
                                self.model.gradient_accumulation_steps, self.world_size, self.world_size_source)
        self._init_scalars()
        self._init_sections()
        if self.model.vocabulary_size is not None and self.model.vocabulary_size % 8 != 0:
            logger.warning(f"vocabulary_size {self.model.vocabulary_size} is not a multiple of 8; "
                           "this may hurt tensor-core performance")

    def _init_scalars(self) -> None:
        m = self.model
        optimizer, scheduler = m.optimizer, m.scheduler
        name = optimizer.type if optimizer is not None else None
        self.optimizer_name = name.lower() if name is not None and name.lower() in DEEPSPEED_OPTIMIZERS else name
        self.optimizer_params = dict(optimizer.params) if optimizer is not None else None
        self.optimizer_legacy_fusion = optimizer.legacy_fusion if optimizer is not None else False
        self.scheduler_name = scheduler.type if scheduler is not None else None
        self.scheduler_params = dict(scheduler.params) if scheduler is not None else None
        for key in ("gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
                    "communication_data_type", "seq_parallel_communication_data_type", "steps_per_print",
                    "wall_clock_breakdown", "memory_breakdown", "dump_state", "dataloader_drop_last", "log_level",
                    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "vocabulary_size",
                    "sequence_parallel_size", "managed_gradient_accumulation", "disable_allgather"):
            setattr(self, key, getattr(m, key))
        if m.flops_profiler.enabled:
            self.wall_clock_breakdown = True
        self.use_data_before_expert_parallel_ = m.use_data_before_expert_parallelism  # DeepSpeed's name

    def _init_sections(self) -> None:
        m = self.model
        self.fp16, self.bf16 = m.fp16, m.bf16
        self.fp16_enabled, self.bf16_enabled = m.fp16.enabled, m.bf16.enabled
        self.fp16_auto_cast = m.fp16.auto_cast
        self.fp16_master_weights_and_gradients = m.fp16.fp16_master_weights_and_grads
        self.loss_scale = m.fp16.loss_scale if m.fp16.enabled else 0.0
        self.initial_dynamic_scale = m.fp16.initial_dynamic_scale
        self.dynamic_loss_scale_args = m.fp16.dynamic_loss_scale_args
        self.grad_accum_dtype = m.data_types.grad_accum_dtype
        self.data_types_config = m.data_types
        self.zero_config = m.zero_optimization
        self.zero_optimization_stage = int(m.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.comms_config = m.comms_logger
        self.monitor_config = DeepSpeedMonitorConfig(tensorboard=m.tensorboard, csv_monitor=m.csv_monitor,
                                                     wandb=m.wandb, comet=m.comet)
        self.flops_profiler_config = m.flops_profiler
        self.activation_checkpointing_config = m.activation_checkpointing
        self.checkpoint_config = m.checkpoint
        self.checkpoint_tag_validation_mode = m.checkpoint.tag_validation
        self.load_universal_checkpoint = m.checkpoint.load_universal
        self.use_node_local_storage = m.checkpoint.use_node_local_storage
        self.aio_config = m.aio
        self.timers_config = m.timers
        self.pipeline = m.pipeline
        self.tensor_parallel_config = m.tensor_parallel
        self.compile_config = m.compile

    def print(self, name: str) -> None:
        """DeepSpeed's dump: every attribute padded with dots, then the raw config as JSON."""
        logger.info(f"{name}:")
        for attr in sorted(vars(self)):
            if attr not in ("_param_dict", "model"):
                logger.info(f"  {attr} {'.' * (29 - len(attr))} {getattr(self, attr)!r}")
        if self.resolved_auto_keys:
            logger.info(f"  \"auto\" resolved to defaults: {', '.join(self.resolved_auto_keys)}")
        logger.info(f"  json = {_scientific_json(self._param_dict)}")

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({_scientific_json(self._param_dict)})"


def _scientific_json(value: Any, indent: int = 4, level: int = 1) -> str:
    """JSON with numbers above 1e3 in %e form, like DeepSpeed's ScientificNotationEncoder."""
    pad, inner = " " * indent * (level - 1), " " * indent * level
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}:{_scientific_json(v, indent, level + 1)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scientific_json(v, indent, level + 1) for v in value) + "]"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1e3:
        return f"{value:e}"
    return json.dumps(value, default=str)
