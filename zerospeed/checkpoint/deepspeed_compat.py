"""DeepSpeed's pickled checkpoint classes: read without DeepSpeed, and written under its names.

DeepSpeed's optim files pickle four of its classes (`deepspeed/runtime/zero/stage_1_and_2.py::
DeepSpeedZeroOptimizer.state_dict`): the loss scaler (static or
dynamic), `ZeroStageEnum` and the stage 1/2 `fragment_address`; its loaders use them as objects
(`loss_scaler.scale_loss(...)`), so a plain dict in their place breaks DeepSpeed's resume.

Reading: the weights-only unpickler is given inert stand-ins registered under exactly those four
names (nothing else is allowed but the enum members of safe_enums.py), and the result is turned into the plain types zerospeed's
loaders use: loss scaler -> dict, stage -> int, fragment -> {"numel", "start"}, tensors detached.

Writing (`save_with_deepspeed_names`): the same stand-ins are pickled under DeepSpeed's module
paths. pickle normally records a class by its own `__module__`/`__qualname__` and checks that
importing that path gives the same object; the pure-Python pickler below writes DeepSpeed's path
for the four stand-ins instead, so the file needs no DeepSpeed to be written and DeepSpeed's
`torch.load` finds its real classes in it (instance state is a plain attribute dict, which is
all DeepSpeed's classes keep). Everything else pickles as usual.
"""

from __future__ import annotations

import pickle
import types
from collections import OrderedDict
from typing import IO, Any

import torch

__all__ = ["DEEPSPEED_GLOBALS", "DeepSpeedLossScaler", "DeepSpeedDynamicLossScaler", "DeepSpeedZeroStage",
           "DeepSpeedFragmentAddress", "to_plain_deepspeed", "save_with_deepspeed_names"]


class DeepSpeedLossScaler:
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler: only its attributes."""

    dynamic = False

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


class DeepSpeedDynamicLossScaler(DeepSpeedLossScaler):
    dynamic = True


class DeepSpeedZeroStage(int):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an int enum)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (int(self),)   # as an Enum member pickles: the class called with its value


class DeepSpeedFragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (a dataclass: numel, start)."""

    def __init__(self, numel: int = 0, start: int = 0) -> None:
        self.numel, self.start = numel, start


DEEPSPEED_GLOBALS: list[tuple[type, str]] = [
    (DeepSpeedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedDynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (DeepSpeedFragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
_DEEPSPEED_NAME_OF = {cls: path for cls, path in DEEPSPEED_GLOBALS}


def to_plain_deepspeed(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach()   # DeepSpeed saves its fp32 partitions as Parameters (requires_grad)
    if isinstance(obj, DeepSpeedLossScaler):
        state = {k: v for k, v in vars(obj).items() if k != "dtype"}
        return {**state, "dynamic": bool(state.get("dynamic", obj.dynamic))}
    if isinstance(obj, DeepSpeedZeroStage):
        return int(obj)
    if isinstance(obj, DeepSpeedFragmentAddress):
        return {"numel": int(vars(obj)["numel"]), "start": int(vars(obj)["start"])}
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, to_plain_deepspeed(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: to_plain_deepspeed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_plain_deepspeed(v) for v in obj)
    return obj


# The pure-Python pickler: private, so typeshed does not describe it.
_PurePythonPickler: Any = getattr(pickle, "_Pickler")  # noqa: B009


class _DeepSpeedNamesPickler(_PurePythonPickler):
    """The pure-Python pickler (the C one cannot be overridden per class) writing DeepSpeed's
    module path for the stand-ins, without importing it."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        path = _DEEPSPEED_NAME_OF.get(obj)
        if path is None:
            super().save_global(obj, name)
            return
        module, _, qualname = path.rpartition(".")
        self.write(pickle.GLOBAL + module.encode("ascii") + b"\n" + qualname.encode("ascii") + b"\n")
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("zerospeed_deepspeed_names_pickle")
_PICKLE_MODULE.Pickler = _DeepSpeedNamesPickler  # type: ignore[attr-defined]


def save_with_deepspeed_names(obj: Any, handle: IO[bytes]) -> None:
    """torch.save, with the stand-ins recorded under DeepSpeed's class paths."""
    torch.save(obj, handle, pickle_module=_PICKLE_MODULE)
