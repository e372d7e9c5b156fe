"""The ``zero_optimization`` ds_config section (DeepSpeed's
`deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig`).

Stage-3 knobs keep both spellings, e.g. ``prefetch_bucket_size`` and
``stage3_prefetch_bucket_size``; the attribute is always the short name. The deprecated
``cpu_offload`` / ``cpu_offload_param`` booleans become offload blocks, and a bare
``"zero_optimization": true`` is translated by the root config (stage 1).

`ZeroStageEnum` keeps DeepSpeed's name and module path: DeepSpeed's optimizer checkpoints pickle
``deepspeed.runtime.zero.config.ZeroStageEnum``.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any, ClassVar

from pydantic import AliasChoices, Field, field_validator, model_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel, Deprecated, warn_config
from zerospeed.utils.z3_leaf_module import DeepSpeedZeroLeafModuleConfig
from zerospeed.runtime.zero.offload.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum"]


class ZeroStageEnum(IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _stage3(name: str, default: Any, **constraints: Any) -> Any:
    """A field readable as `name` or as DeepSpeed's `stage3_<name>` alias."""
    return Field(default, validation_alias=AliasChoices(name, f"stage3_{name}"), **constraints)


def _cpu_block(enabled: Any) -> dict[str, str] | None:
    return {"device": OffloadDeviceEnum.cpu.value} if enabled else None


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    deprecated_keys: ClassVar[dict[str, Deprecated]] = {
        "cpu_offload": Deprecated("offload_optimizer", _cpu_block),
        "cpu_offload_param": Deprecated("offload_param", _cpu_block),
        "cpu_offload_use_pin_memory": Deprecated(None, note="Set pin_memory in the offload blocks."),
        "stage3_gather_fp16_weights_on_model_save": Deprecated("gather_16bit_weights_on_model_save"),
    }

    stage: ZeroStageEnum = ZeroStageEnum.disabled
    """0 off, 1 optimizer states, 2 + gradients, 3 + parameters."""
    contiguous_gradients: bool = True
    """Copy each gradient into a preallocated bucket as it is produced."""
    reduce_scatter: bool = True
    """Reduce each gradient slice to its owner instead of a full all-reduce."""
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    """Elements per gradient bucket."""
    use_multi_rank_bucket_allreduce: bool = True
    """Stage 1/2: one all-reduce per bucket; each rank keeps its own slices."""
    allgather_partitions: bool = True
    """All-gather (vs broadcasts) the updated partitions after the step."""
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    """Elements per all-gather after the step; must be even."""
    overlap_comm: bool | None = Field(None, validate_default=True)
    """Overlap gradient reduction with backward; None means `stage == 3`."""
    load_from_fp32_weights: bool = True
    """On load, take the fp32 master from the checkpoint rather than the 16-bit weights."""
    elastic_checkpoint: bool = False
    """Stage 1/2: save unpadded optimizer state so a checkpoint can be re-partitioned."""
    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3)."""
    sub_group_size: int = Field(1_000_000_000, ge=0)
    """Stage 3: partition elements per optimizer sub-group."""
    prefetch_bucket_size: int = _stage3("prefetch_bucket_size", 50_000_000, ge=0)
    """Stage 3: most elements prefetched ahead."""
    param_persistence_threshold: int = _stage3("param_persistence_threshold", 100_000, ge=0)
    """Stage 3: params with numel <= this stay gathered."""
    model_persistence_threshold: int = _stage3("model_persistence_threshold", sys.maxsize, ge=0)
    """Stage 3: cap on the total numel of persistent params."""
    max_live_parameters: int = _stage3("max_live_parameters", 1_000_000_000, ge=0)
    """Stage 3: cap on gathered elements."""
    max_reuse_distance: int = _stage3("max_reuse_distance", 1_000_000_000, ge=0)
    """Stage 3: keep a param gathered if reused within this many elements of the trace."""
    gather_16bit_weights_on_model_save: bool = _stage3("gather_16bit_weights_on_model_save", False)
    """Stage 3: let save_16bit_model() consolidate the weights."""
    module_granularity_threshold: int = _stage3("module_granularity_threshold", 0, ge=0)
    """Stage 3: fetch fine-grained modules as one leaf."""
    use_all_reduce_for_fetch_params: bool = _stage3("use_all_reduce_for_fetch_params", False)
    """Stage 3: gather params by all-reducing a zero-filled buffer."""
    allgather_sequential: bool = _stage3("allgather_sequential", False)
    """Stage 3: gather param by param (forces prefetch_bucket_size=1)."""
    ignore_unused_parameters: bool = True
    """Stage 2: tolerate params that got no gradient."""
    legacy_stage1: bool = False
    """Removed; true is an error."""
    round_robin_gradients: bool = False
    """Stage 1/2: interleave gradient owners for parallel CPU copies."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """ZeRO++ hpZ secondary partition size."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ."""
    zero_quantized_nontrainable_weights: bool = False
    """Store frozen weights quantized."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ."""
    memory_efficient_linear: bool = True
    """zero.Init swaps in a memory-efficient F.linear."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints serially across local ranks."""
    override_module_apply: bool = True
    """Stage 3: make module.apply gather params first."""
    log_trace_cache_warnings: bool = False
    """Log when the stage-3 trace is invalidated."""
    enable_sanity_checks: bool = False
    """Stage 3: compare the gathered ds_ids across ranks before every gather ([Note: gather-order check])."""
    check_module_order: bool = _stage3("check_module_order", True)
    """zerospeed's, stage 3: once per backward, check that every rank gathered the same parameters in
    the same order, i.e. called the same submodules ([Note: gather-order check]); one small all-gather."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Muon with nvme."""
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)
    """Stage 3: modules gathered whole, their children unhooked ([Note: ZeRO-3 leaf modules])."""
    zenflow: dict[str, Any] | None = None
    """ZenFlow (not implemented: refused when given, config_unimplemented)."""
    parameter_alignment: bool = False
    """Stage 1/2: start each param of the flat buffer on a 16-byte boundary."""
    compute_grad_norm: bool = True
    """Stage 1/2: compute and keep the global gradient norm."""
    mics_shard_size: int = -1
    """MiCS (removed in DeepSpeed 0.19.8; refused when given, as DeepSpeed does)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS (removed in DeepSpeed 0.19.8; refused when given, as DeepSpeed does)."""
    zeropp_loco_param: dict[str, Any] | None = None
    """ZeRO++ LoCo (removed in DeepSpeed 0.19.8; refused when given, as DeepSpeed does)."""

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_range(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value > ZeroStageEnum.max_stage:
            raise ValueError("Maximum supported ZeRO stage is 3")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {value}")
        return value

    @field_validator("overlap_comm")
    @classmethod
    def _overlap_default(cls, value: bool | None, info: Any) -> bool:
        return info.data.get("stage") == ZeroStageEnum.weights if value is None else value

    @field_validator("allgather_bucket_size")
    @classmethod
    def _even(cls, value: int, info: Any) -> int:
        # DeepSpeed's stage-1/2 optimizer asserts it (4-byte alignment of fp16 send buffers);
        # stages 0 and 3 never read the key, there or here.
        if value % 2 != 0 and info.data.get("stage") in (ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients):
            raise ValueError(f"must be a multiple of 2 at stages 1 and 2, got {value}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> DeepSpeedZeroConfig:
        if self.legacy_stage1:
            raise ValueError("legacy_stage1 has been removed; drop it from the config")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1:
            self._check_partial_offload()
        if self.elastic_checkpoint and self.stage == 3:
            raise ValueError("elastic_checkpoint is not supported with ZeRO stage 3")
        if self.offload_param is not None and self.offload_param.enabled and self.stage != 3:
            warn_config(f"zero_optimization.offload_param only applies to ZeRO stage 3; it is ignored "
                        f"at stage {int(self.stage)}")
        # zenflow, MiCS and LoCo are refused before validation (config_unimplemented).
        if not self.compute_grad_norm and self.stage == 3:
            raise ValueError("compute_grad_norm=false is only supported for ZeRO stages 1 and 2")
        return self

    def _check_partial_offload(self) -> None:
        """`offload_optimizer.ratio < 1`: stage 3 only (DeepSpeed's check); inert without optimizer offload."""
        if self.stage != 3:
            raise ValueError("Partial offloading only supported for ZeRO Stage 3")
        if not self.offload_optimizer.enabled:  # type: ignore[union-attr]
            warn_config("zero_optimization.offload_optimizer.ratio is ignored: offload_optimizer.device is 'none'")
        elif self.offload_param is not None and self.offload_param.device == OffloadDeviceEnum.nvme:
            raise ValueError("zero_optimization.offload_optimizer.ratio < 1 is not supported with "
                             "offload_param.device 'nvme': set ratio to 1 or offload_param.device to 'cpu'")

    @property
    def offload_optimizer_device(self) -> OffloadDeviceEnum:
        return self.offload_optimizer.device if self.offload_optimizer else OffloadDeviceEnum.none

    @property
    def offload_param_device(self) -> OffloadDeviceEnum:
        return self.offload_param.device if self.offload_param else OffloadDeviceEnum.none
