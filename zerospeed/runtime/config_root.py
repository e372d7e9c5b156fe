"""`DeepSpeedRootConfig`: every top-level ds_config key, with DeepSpeed's defaults, one model per
section (each section's model lives with its owner: ``fp16``/``bf16`` in precision_config,
``zero_optimization`` in zero/config, monitors in monitor/config, the rest in config_sections and
config_optimizer). Cross-section rules are checked here.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import AliasChoices, BeforeValidator, Field, field_validator, model_validator

from zerospeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from zerospeed.runtime.compile_config import CompileConfig
from zerospeed.runtime.config_optimizer import OptimizerConfig, SchedulerConfig
from zerospeed.runtime.config_sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    CommsLoggerConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    PipelineConfig,
    TimersConfig,
)
from zerospeed.runtime.config_unimplemented import (
    KNOWN_ELSEWHERE,
    NOT_IMPLEMENTED,
    REMOVED_UPSTREAM,
    screen_sections,
)
from zerospeed.runtime.config_utils import DeepSpeedConfigModel, parse_dtype, warn_config
from zerospeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from zerospeed.runtime.tensor_parallel.config import TPTrainingConfig
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum

__all__ = ["UNIMPLEMENTED_KEYS", "DeepSpeedRootConfig"]

UNIMPLEMENTED_KEYS = (*REMOVED_UPSTREAM, *NOT_IMPLEMENTED)
"""DeepSpeed 0.19.8's top-level sections zerospeed does not implement (config_unimplemented)."""

CommDtype = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]


def _section(model: type[DeepSpeedConfigModel]) -> Any:
    return Field(default_factory=model)


class DeepSpeedRootConfig(DeepSpeedConfigModel):
    """Every top-level ds_config key, with DeepSpeed's defaults."""

    known_elsewhere_keys: ClassVar[dict[str, str]] = KNOWN_ELSEWHERE

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: DeepSpeedFP16Config = _section(DeepSpeedFP16Config)
    bf16: DeepSpeedBF16Config = Field(default_factory=DeepSpeedBF16Config, validation_alias=AliasChoices("bf16", "bfloat16"))
    zero_optimization: DeepSpeedZeroConfig = _section(DeepSpeedZeroConfig)
    data_types: DataTypesConfig = _section(DataTypesConfig)
    comms_logger: CommsLoggerConfig = _section(CommsLoggerConfig)
    tensorboard: TensorBoardConfig = _section(TensorBoardConfig)
    csv_monitor: CSVConfig = _section(CSVConfig)
    wandb: WandbConfig = _section(WandbConfig)
    comet: CometConfig = _section(CometConfig)
    flops_profiler: FlopsProfilerConfig = _section(FlopsProfilerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = _section(ActivationCheckpointingConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    aio: AioConfig = _section(AioConfig)
    timers: TimersConfig = _section(TimersConfig)
    pipeline: PipelineConfig = _section(PipelineConfig)
    tensor_parallel: TPTrainingConfig = _section(TPTrainingConfig)
    compile: CompileConfig = _section(CompileConfig)

    gradient_clipping: float = Field(1.0, ge=0.0)
    """Global L2 clip; 0 disables it (default 1.0 since DeepSpeed 0.19.3)."""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: CommDtype = None
    seq_parallel_communication_data_type: CommDtype = torch.float32
    steps_per_print: int | None = Field(None, ge=1)
    """Log every N steps; None (or infinity, which accelerate sends) never."""
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    vocabulary_size: int | None = Field(None, ge=1)
    sequence_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int | None = Field(None, ge=1)
    """With sequence_parallel_size, the data axis of the (data, sequence) mesh; `initialize` reads both."""
    use_data_before_expert_parallelism: bool = False
    """MoE group layout: expert-data-parallel ranks consecutive ("D + E") instead of expert-parallel ones."""
    managed_gradient_accumulation: bool = True
    allgather_size: int = Field(500_000_000, ge=0)
    """Only read by the deprecated `"zero_optimization": true` form."""
    disable_allgather: bool = False


    @classmethod
    def screen_top_level(cls, data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
        """Called by the key rules before anything else ([Note: refuse or warn] in config_unimplemented)."""
        return screen_sections(data, problems)

    @model_validator(mode="before")
    @classmethod
    def _translate_top_level(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("zero_optimization"), bool):
            warn_config('"zero_optimization": true/false is deprecated; use {"stage": N}')
            enabled = data.pop("zero_optimization")
            data["zero_optimization"] = {"stage": int(enabled),
                                         "allgather_bucket_size": data.get("allgather_size", 500_000_000)}
        if isinstance(data.get("log_level"), str):
            data["log_level"] = data["log_level"].lower()
        return data

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_is_never(cls, value: Any) -> Any:
        return None if isinstance(value, float) and math.isinf(value) and value > 0 else value

    @model_validator(mode="after")
    def _cross_section_checks(self) -> DeepSpeedRootConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("bfloat16 and fp16 modes cannot be simultaneously enabled")
        stage = self.zero_optimization.stage
        if self.gradient_allreduce_op == "sum" and stage == ZeroStageEnum.weights:
            raise ValueError("gradient_allreduce_op 'sum' is not supported with ZeRO stage 3")
        model_dtype = torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16.enabled else torch.float32
        if self.data_types.param_dtype is not None and self.data_types.param_dtype != model_dtype:
            raise ValueError(f"data_types.param_dtype {self.data_types.param_dtype} does not match the "
                             f"precision mode ({model_dtype}); set fp16/bf16 instead")
        if self.fp16.fp16_master_weights_and_grads and (
                stage == 0 or self.zero_optimization.offload_optimizer_device.value != "cpu"):
            raise ValueError("fp16.fp16_master_weights_and_grads requires ZeRO stage 1-3 with "
                             "offload_optimizer.device 'cpu'")
        if self.bf16.bf16_master_weights_and_grads and stage == 0:
            raise ValueError("bf16.bf16_master_weights_and_grads requires ZeRO stage 1-3")
        return self
