"""The ``optimizer`` and ``scheduler`` ds_config sections.

``params`` are the constructor's keyword arguments, passed through; the checks here catch what
would otherwise fail deep inside the constructor (a number given as a string, DeepSpeed's
``max_grad_norm`` rule) and name the key path.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, field_validator

from zerospeed.runtime.config_utils import AUTO, ConfigKeyError, DeepSpeedConfigModel, suggest_key

__all__ = ["DEEPSPEED_OPTIMIZERS", "DEEPSPEED_SCHEDULERS", "OptimizerConfig", "SchedulerConfig"]

DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad",
                        "lion", "muadam", "muadamw", "musgd", "muon")
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


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
