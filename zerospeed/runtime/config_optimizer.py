"""The ``optimizer`` and ``scheduler`` ds_config sections.

``params`` are the constructor's keyword arguments, passed through; the checks here catch what
would otherwise fail deep inside the constructor (a number given as a string, DeepSpeed's
``max_grad_norm`` rule) and name the key path.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from zerospeed.runtime.config_utils import AUTO, ConfigKeyError, DeepSpeedConfigModel, suggest_key

__all__ = ["DEEPSPEED_OPTIMIZERS", "DEEPSPEED_SCHEDULERS", "REMOVED_OPTIMIZERS", "OptimizerConfig",
           "SchedulerConfig"]

DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "adagrad", "lion", "muadam", "muadamw", "musgd", "muon")
"""DeepSpeed 0.19.8's names, matched in any case and reported lower-cased (`optimizer_name`)."""
REMOVED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
"""Names DeepSpeed 0.19.8 no longer builds: a config naming one loads (its name kept as written, as
DeepSpeed keeps it) and `initialize` refuses it (optimizer_factory), where DeepSpeed fails too."""
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
        if name is None or name.lower() in DEEPSPEED_OPTIMIZERS or name.lower() in REMOVED_OPTIMIZERS:
            return name
        if isinstance(getattr(torch.optim, name, None), type):
            return name
        torch_names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)]
        hint = suggest_key(name.lower(), DEEPSPEED_OPTIMIZERS) or suggest_key(name, torch_names)
        raise ValueError(f"{name} is not a supported DeepSpeed Optimizer{hint}")

    @field_validator("params")
    @classmethod
    def _checked_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in params:
            raise ConfigKeyError("max_grad_norm", "'max_grad_norm' is not supported as an optimizer parameter, "
                                 "please switch to using the deepspeed parameter 'gradient_clipping' (top level)")
        return checked_params(params)

    @model_validator(mode="after")
    def _type_given(self) -> OptimizerConfig:
        # Without a type the engine has no optimizer to build; DeepSpeed fails at the first backward.
        if self.type is None:
            raise ConfigKeyError("type", "missing: an optimizer block needs a type (for example \"AdamW\"), "
                                 "or remove the block and pass an optimizer to initialize()")
        return self


class SchedulerConfig(DeepSpeedConfigModel):
    type: str | None = None
    """A zerospeed.runtime.lr_schedules name, else a torch.optim.lr_scheduler class name."""
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _checked_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return checked_params(params)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str | None) -> str | None:
        if name is None or name in DEEPSPEED_SCHEDULERS or isinstance(getattr(torch.optim.lr_scheduler, name, None), type):
            return name
        torch_names = [n for n in dir(torch.optim.lr_scheduler) if n[0].isupper()]
        raise ValueError(f"{name} is not a valid LR scheduler" + suggest_key(name, [*DEEPSPEED_SCHEDULERS, *torch_names]))


_BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off")
_NUMERIC_PARAMS = ("lr", "weight_decay", "eps", "momentum", "dampening", "warmup_min_lr", "warmup_max_lr",
                   "warmup_num_steps", "total_num_steps")


def checked_params(params: dict[str, Any]) -> dict[str, Any]:
    """Constructor kwargs without "auto" values; a number or boolean written as a string is an error
    naming the key (it would otherwise fail deep inside the constructor, or be used as a string)."""
    for key, value in params.items():
        if isinstance(value, str) and value != AUTO and (_looks_scalar(value) or key in _NUMERIC_PARAMS):
            raise ConfigKeyError(key, f"expected a number or boolean, got the string {value!r}")
    return {key: value for key, value in params.items() if value != AUTO}


def _looks_scalar(text: str) -> bool:
    if text.strip().lower() in _BOOLEAN_WORDS:
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True
