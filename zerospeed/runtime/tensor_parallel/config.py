"""The ``tensor_parallel`` ds_config section (DeepSpeed's ``TPTrainingConfig``, keys and defaults).

``autotp_size`` > 1 switches AutoTP training on: the engine shards the model's linear layers over
``autotp_size`` ranks (shard.py) and runs data parallelism over the rest. ``tp`` (alias of
``tensor_parallel``) is DeepSpeed's nested ``TPConfig``; its ``tp_size`` must agree with
``autotp_size`` when both are given (DeepSpeed users mix the two up: DS#7389).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field, model_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel, parse_dtype, warn_config

__all__ = ["TPConfig", "TPTrainingConfig", "get_tensor_parallel_config"]

Dtype = Annotated[torch.dtype, BeforeValidator(parse_dtype)]


class TPConfig(DeepSpeedConfigModel):
    """DeepSpeed's nested ``tensor_parallel.tp`` block."""

    tp_size: int = Field(1, ge=1)
    """Ranks one model replica is split over (defaults to ``autotp_size`` when that is set)."""
    tp_grain_size: int = Field(1, ge=1)
    """Granularity of uneven MLP splits in DeepSpeed; zerospeed splits evenly and ignores it."""
    mpu: Any = None
    """A Megatron-style mpu; zerospeed builds its groups from its own topology (ignored)."""
    tp_group: Any = None
    """A ready tensor-parallel process group; must hold ``autotp_size`` ranks when given."""


class TPTrainingConfig(DeepSpeedConfigModel):
    """``tensor_parallel``: AutoTP training."""

    dtype: Dtype = torch.float16
    """The dtype the model is converted to (DeepSpeed's field; the engine's precision mode rules)."""
    autotp_size: int = Field(0, ge=0)
    """Tensor-parallel degree; 0 (and 1) leave AutoTP off."""
    tp_overlap_comm: bool = False
    """DeepSpeed's async all-reduce overlap; zerospeed runs the all-reduce in line (accepted, ignored)."""
    vocab_parallel_lm_head: bool | None = None
    """True asks for a vocabulary-sharded output head with a distributed loss (not implemented)."""
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tensor_parallel: TPConfig = Field(default_factory=TPConfig, alias="tp")  # type: ignore[arg-type]
    injection_policy_tuple: tuple[Any, ...] | None = None
    partition_config: dict[str, Any] | None = None
    """Custom rules: ``{"use_default_specs": bool, "layer_specs": [{"patterns": [...],
    "partition_type": "row" | "column" | "skip"}]}`` (plan.py)."""
    preset_model: str | None = None
    """DeepSpeed's named presets; zerospeed's name rules cover them (accepted, the rules apply)."""
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")

    @model_validator(mode="after")
    def _check(self) -> TPTrainingConfig:
        nested = self.tensor_parallel.tp_size
        if self.autotp_size > 1 and nested not in (1, self.autotp_size):
            raise ValueError(f"tensor_parallel.tp.tp_size ({nested}) does not match "
                             f"tensor_parallel.autotp_size ({self.autotp_size})")
        if self.vocab_parallel_lm_head:
            raise ValueError("tensor_parallel.vocab_parallel_lm_head=true (vocabulary-parallel output head and "
                             "loss) is not implemented in zerospeed; leave it unset or false")
        if self.replace_with_kernel_inject:
            raise ValueError("tensor_parallel.kernel_inject (inference kernels) is not supported for training")
        if self.tp_overlap_comm:
            warn_config("tensor_parallel.tp_overlap_comm is accepted and ignored: the all-reduce runs in line")
        return self

    @property
    def tp_size(self) -> int:
        """The effective degree: ``autotp_size`` when AutoTP is on (> 1), else 1 (DeepSpeed's gate)."""
        return self.autotp_size if self.autotp_size > 1 else 1


def get_tensor_parallel_config(ds_config: dict[str, Any]) -> TPTrainingConfig:
    """DeepSpeed's helper: the section of a raw ds_config dict, defaults when absent."""
    return TPTrainingConfig(**ds_config.get("tensor_parallel", {}))
