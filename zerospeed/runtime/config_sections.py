"""The small ds_config sections that have no owner module yet (they move next to their owner
when it arrives): ``data_types``, ``comms_logger``, ``flops_profiler``, ``activation_checkpointing``,
``checkpoint``, ``aio``, ``timers``, ``pipeline``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import AliasChoices, BeforeValidator, Field, field_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel, parse_dtype

__all__ = ["ActivationCheckpointingConfig", "AioConfig", "CheckpointConfig", "CheckpointWriterConfig",
           "CommsLoggerConfig", "DataTypesConfig", "Dtype", "FlopsProfilerConfig", "ParallelWriteConfig",
           "PipelineConfig", "ThroughputTimerConfig", "TimersConfig"]

Dtype = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]


class DataTypesConfig(DeepSpeedConfigModel):
    grad_accum_dtype: Dtype = None
    """Gradient accumulation dtype; None means the model dtype."""
    param_dtype: Dtype = None
    """Must match the fp16/bf16 mode when given."""
    buffer_dtype: Dtype = None
    """None leaves buffers in their loaded dtype."""
    keep_in_fp32_modules: str | list[str] = "auto"


class CommsLoggerConfig(DeepSpeedConfigModel):
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class FlopsProfilerConfig(DeepSpeedConfigModel):
    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    profile_step: int = Field(1, ge=1)
    module_depth: int = -1
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: str | None = None


class ActivationCheckpointingConfig(DeepSpeedConfigModel):
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class CheckpointWriterConfig(DeepSpeedConfigModel):
    type: Literal["MOCK", "PYTHON", "FAST"] = "FAST"
    io_buffer_size: int = Field(64 * 1024 * 1024, gt=0)
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Literal["REPLICA", "SOCKET", "MACHINE"] | None = None
    decoupled: bool = False
    io_multiplier: int = Field(1, ge=1)

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(DeepSpeedConfigModel):
    pipeline_stage: bool = False


class CheckpointConfig(DeepSpeedConfigModel):
    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """Check that all ranks save under the same tag (case-insensitive)."""
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: CheckpointWriterConfig | None = None

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalize(cls, value: Any) -> Any:
        return value.capitalize() if isinstance(value, str) else value


class AioConfig(DeepSpeedConfigModel):
    block_size: int = Field(1_048_576, gt=0)
    queue_depth: int = Field(8, gt=0)
    intra_op_parallelism: int = Field(1, gt=0, validation_alias=AliasChoices("intra_op_parallelism", "thread_count"))
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class ThroughputTimerConfig(DeepSpeedConfigModel):
    enabled: bool = True
    synchronized: bool = True


class TimersConfig(DeepSpeedConfigModel):
    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class PipelineConfig(DeepSpeedConfigModel):
    stages: int | Literal["auto"] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    """zerospeed: the pipeline schedule (DeepSpeed has 1F1B only); interleaved needs PipelineModule(num_chunks>1)."""

    @field_validator("schedule", mode="before")
    @classmethod
    def _lower_schedule(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
