"""The ds_config: loading, the root model, the batch triangle, and `DeepSpeedConfig`.

A config arrives as a dict, a path to a JSON/HJSON file, or urlsafe-base64 JSON (`load_ds_config`).
It is validated once, as `DeepSpeedRootConfig`, whose fields are the top-level keys with
DeepSpeed's defaults (reference §2.7) and one model per section; sections that have an owner
module live there (``fp16``/``bf16`` in precision_config, ``zero_optimization`` in zero/config,
monitors in monitor/config). Unlike DeepSpeed, an unknown *top-level* key is an error too, with a
did-you-mean; DeepSpeed keys zerospeed does not implement yet are accepted with one warning.

`resolve_batch_sizes` is the one place the batch triangle is derived (§2.2). `DeepSpeedConfig`
is the flat view the engine reads: the resolved batch sizes plus DeepSpeed's attribute names.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from typing import Annotated, Any, Literal

import hjson
import torch
from pydantic import AliasChoices, BeforeValidator, Field, field_validator, model_validator

from zerospeed.monitor.config import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zerospeed.runtime.config_utils import (
    AUTO,
    ConfigError,
    ConfigKeyError,
    DeepSpeedConfigModel,
    parse_dtype,
    suggest_key,
    validate_section,
    warn_config,
)
from zerospeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from zerospeed.utils.logging import logger

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "UNIMPLEMENTED_KEYS",
    "DeepSpeedConfig",
    "DeepSpeedRootConfig",
    "load_ds_config",
    "resolve_batch_sizes",
]

DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad",
                        "lion", "muadam", "muadamw", "musgd", "muon")
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
UNIMPLEMENTED_KEYS = (
    "amp", "compile", "hybrid_engine", "tensor_parallel", "elasticity", "compression_training",
    "autotuning", "sparse_attention", "curriculum_learning", "data_efficiency", "quantize_training",
    "nebula", "datastates", "zenflow", "eigenvalue", "progressive_layer_drop", "sparse_gradients",
    "graph_harvesting", "torch_autocast", "expert_parallel", "use_data_before_expert_parallelism",
    "weight_quantization", "disable_python_gc",
)
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

Dtype = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]
CommDtype = Annotated[torch.dtype | None, BeforeValidator(parse_dtype)]


# --------------------------------------------------------------------------------------------
# sections without an owner module yet (they move next to their owner when it arrives)


class OptimizerConfig(DeepSpeedConfigModel):
    type: str | None = None
    """A DeepSpeed optimizer name (any case) or a `torch.optim` class name (exact case)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor keyword arguments; an "auto" value is dropped so the optimizer default applies."""
    legacy_fusion: bool = False

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str | None) -> str | None:
        if name is None or name.lower() in DEEPSPEED_OPTIMIZERS:
            return name
        if isinstance(getattr(torch.optim, name, None), type):
            return name
        torch_names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)]
        hint = suggest_key(name.lower(), DEEPSPEED_OPTIMIZERS) or suggest_key(name, torch_names)
        raise ValueError(f"{name} is not a supported DeepSpeed Optimizer{hint}")

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in params:
            raise ConfigKeyError("max_grad_norm", "'max_grad_norm' is not supported as an optimizer parameter, "
                                 "please switch to using the deepspeed parameter 'gradient_clipping' (top level)")
        return {key: value for key, value in params.items() if value != AUTO}


class SchedulerConfig(DeepSpeedConfigModel):
    type: str | None = None
    """A zerospeed.runtime.lr_schedules name, else a torch.optim.lr_scheduler class name."""
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str | None) -> str | None:
        if name is None or name in DEEPSPEED_SCHEDULERS or isinstance(getattr(torch.optim.lr_scheduler, name, None), type):
            return name
        torch_names = [n for n in dir(torch.optim.lr_scheduler) if n[0].isupper()]
        raise ValueError(f"{name} is not a valid LR scheduler" + suggest_key(name, [*DEEPSPEED_SCHEDULERS, *torch_names]))


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


# --------------------------------------------------------------------------------------------
# the root


def _section(model: type[DeepSpeedConfigModel]) -> Any:
    return Field(default_factory=model)


class DeepSpeedRootConfig(DeepSpeedConfigModel):
    """Every top-level ds_config key, with DeepSpeed's defaults."""

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

    gradient_clipping: float = Field(1.0, ge=0.0)
    """Global L2 clip; 0 disables it (default 1.0 since DeepSpeed 0.19.3)."""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: CommDtype = None
    seq_parallel_communication_data_type: CommDtype = torch.float32
    steps_per_print: int | None = Field(None, ge=1)
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    vocabulary_size: int | None = Field(None, ge=1)
    sequence_parallel_size: int = Field(1, ge=1)
    managed_gradient_accumulation: bool = True
    allgather_size: int = Field(500_000_000, ge=0)
    """Only read by the deprecated `"zero_optimization": true` form."""
    disable_allgather: bool = False


    @model_validator(mode="before")
    @classmethod
    def _translate_top_level(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        present = [key for key in UNIMPLEMENTED_KEYS if key in data]
        if present:
            warn_config(f"ds_config keys not implemented by zerospeed are accepted and ignored: {present}")
            for key in present:
                del data[key]
        if isinstance(data.get("zero_optimization"), bool):
            warn_config('"zero_optimization": true/false is deprecated; use {"stage": N}')
            enabled = data.pop("zero_optimization")
            data["zero_optimization"] = {"stage": int(enabled),
                                         "allgather_bucket_size": data.get("allgather_size", 500_000_000)}
        if isinstance(data.get("log_level"), str):
            data["log_level"] = data["log_level"].lower()
        return data

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


# --------------------------------------------------------------------------------------------
# loading


def load_ds_config(config: Any) -> dict[str, Any]:
    """A ds_config as a plain dict, from a dict, a JSON/HJSON file path, or urlsafe-base64 JSON."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, encoding="utf-8") as handle:
            return hjson.load(handle, object_pairs_hook=_reject_duplicates)
    if isinstance(config, str):
        try:
            decoded = base64.urlsafe_b64decode(config).decode("utf-8")
            loaded = json.loads(decoded, object_pairs_hook=_reject_duplicates)
        except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary or a valid "
                     f"base64. Received: {config}")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicates}")
    return dict(pairs)


def _auto_key_paths(tree: Any, prefix: str = "") -> list[str]:
    """Every key path whose value is "auto" (reported, since DeepSpeed drops them silently)."""
    if not isinstance(tree, dict):
        return []
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths += [path] if value == AUTO else _auto_key_paths(value, path + ".")
    return paths


# --------------------------------------------------------------------------------------------
# the batch triangle


def resolve_batch_sizes(train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None,
                        world_size: int, world_size_source: str | None = None) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps), DeepSpeed's way (§2.2).

    Any two given derive the third by floor division in DeepSpeed's order; one given sets
    GAS = 1. Then every value must be > 0 and TBS == MBS * GAS * world_size, with DeepSpeed's
    assertion messages (plus where the world size came from, the usual culprit).
    """
    tbs, mbs, gas = train_batch_size, micro_batch, grad_acc
    _check_positive(tbs, mbs, gas, allow_none=True)
    if tbs is not None and mbs is not None and gas is None:
        gas = (tbs // mbs) // world_size
    elif tbs is not None and gas is not None and mbs is None:
        mbs = (tbs // world_size) // gas
    elif mbs is not None and gas is not None and tbs is None:
        tbs = mbs * gas * world_size
    elif tbs is not None and mbs is None and gas is None:
        gas, mbs = 1, tbs // world_size
    elif mbs is not None and tbs is None and gas is None:
        gas, tbs = 1, mbs * world_size
    elif tbs is None and mbs is None:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    assert tbs is not None and mbs is not None and gas is not None
    _check_positive(tbs, mbs, gas, allow_none=False)
    if tbs != mbs * gas * world_size:
        source = f" (world_size {world_size} from {world_size_source})" if world_size_source else ""
        raise ConfigError("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
                          f"* gradient_acc_step * world_size {tbs} != {mbs} * {gas} * {world_size}{source}")
    return tbs, mbs, gas


def _check_positive(tbs: int | None, mbs: int | None, gas: int | None, allow_none: bool) -> None:
    for value, message in ((tbs, "Train batch size: {} has to be greater than 0"),
                           (mbs, "Micro batch size per gpu: {} has to be greater than 0"),
                           (gas, "Gradient accumulation steps: {} has to be greater than 0")):
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            raise ConfigError(message.format(value))


def _data_parallel_world_size(world_size: int | None, mpu: Any, mesh_device: Any,
                              sequence_parallel_size: int) -> tuple[int, str]:
    if world_size is not None:
        return world_size, "the world_size argument"
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return mpu.get_data_parallel_world_size(), "mpu.get_data_parallel_world_size()"
    if mesh_device is not None:
        names = list(getattr(mesh_device, "mesh_dim_names", None) or ())
        if "data_parallel" in names:
            return mesh_device.size(names.index("data_parallel")), "the mesh's data_parallel dimension"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if sequence_parallel_size > 1:
            return world // sequence_parallel_size, f"torch.distributed world size {world} / sequence_parallel_size"
        return world, "the torch.distributed world size"
    return 1, "torch.distributed not initialized"


# --------------------------------------------------------------------------------------------
# the engine's view


class DeepSpeedConfig:
    """The validated ds_config with the batch triangle resolved, under DeepSpeed's attribute names."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None, world_size: int | None = None):
        self._param_dict = load_ds_config(config)
        self.resolved_auto_keys = _auto_key_paths(self._param_dict)
        self.model = validate_section(DeepSpeedRootConfig, self._param_dict)
        self.world_size, self.world_size_source = _data_parallel_world_size(
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

