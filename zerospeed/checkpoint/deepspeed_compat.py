"""Reading checkpoint files written by DeepSpeed, without arbitrary unpickling.

DeepSpeed's optim files pickle four of its classes (reference §7.3): the loss scaler (static or
dynamic), `ZeroStageEnum` and the stage 1/2 `fragment_address`. Instead of importing DeepSpeed
or unpickling blindly, the weights-only unpickler is given inert stand-ins registered under
exactly those four names (nothing else is allowed), and the result is turned into the plain
types our own files hold: loss scaler -> dict, stage -> int, fragment -> {"numel", "start"},
tensors detached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["DEEPSPEED_GLOBALS", "load_deepspeed_file", "to_plain_deepspeed"]


class _LossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler: only its attributes."""

    dynamic = False


class _DynamicLossScaler(_LossScaler):
    dynamic = True


class _ZeroStageEnum(int):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an int enum)."""


class _FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (numel, start)."""


DEEPSPEED_GLOBALS: list[tuple[type, str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_deepspeed_file(path: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) with only DeepSpeed's four checkpoint classes allowed."""
    with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):  # type: ignore[arg-type]
        return to_plain_deepspeed(torch.load(path, map_location="cpu", weights_only=True, mmap=mmap))


def to_plain_deepspeed(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach()   # DeepSpeed saves its fp32 partitions as Parameters (requires_grad)
    if isinstance(obj, _LossScaler):
        return {**vars(obj), "dynamic": bool(vars(obj).get("dynamic", obj.dynamic))}
    if isinstance(obj, _ZeroStageEnum):
        return int(obj)
    if isinstance(obj, _FragmentAddress):
        return {"numel": int(vars(obj)["numel"]), "start": int(vars(obj)["start"])}
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, to_plain_deepspeed(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: to_plain_deepspeed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_plain_deepspeed(v) for v in obj)
    return obj
