"""Enum members in weights-only loads: by value or by name, only from an allowlist of enum classes.

pickle writes an `Enum` member in one of two forms, chosen by the interpreter that saved it:
by value, `EnumClass(value)` (3.11.7, 3.12+), or by name, `getattr(EnumClass, "name")` (some
3.11 patch releases, Debian 12's 3.11.2 among them). DeepSpeed pickles its `ZeroStageEnum` into
every optim file, so a checkpoint DeepSpeed wrote under such a Python carries a
`GLOBAL builtins getattr`, which torch's weights-only unpickler refuses like any other callable.

[Note: getattr in weights-only loads]
Allowing `builtins.getattr` itself would let a pickle read any attribute of anything it can put
on the stack (`OrderedDict.__init__`, a tensor's methods, a module reached through an allowed
global), so it is never registered. Instead `enum_member` is registered under that name in
torch's `safe_globals` (the `(callable, "pickled.path")` form torch provides for stand-ins):
the unpickler calls it in getattr's place, and it returns a member only when its first argument
is one of the enum classes below and its second the name of one of that class's members;
anything else raises `pickle.UnpicklingError`, which torch reports as a refused weights-only
load and `manifest.load_file` as "needs arbitrary unpickling", the same message as any other
refused global. The classes are registered too, under every path a checkpoint may name them by:
DeepSpeed's paths resolve to zerospeed's classes (its `ZeroStageEnum` to the inert stand-in of
deepspeed_compat.py, which becomes a plain int), so DeepSpeed need not be importable.

The allowlist is config enums a training checkpoint holds (DeepSpeed pickles `ZeroStageEnum`;
the offload device is a config value a user's `client_state` may keep) and torch's AMP step
state. The standalone utils/zero_to_fp32.py keeps its own copy of this rule (it may import
nothing from zerospeed); tests/checkpoint/test_safe_enums.py holds the two to the same members.
"""

from __future__ import annotations

import enum
import functools
import pickle
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed_compat import DEEPSPEED_GLOBALS, DeepSpeedZeroStage, to_plain_deepspeed

__all__ = ["GETATTR_PATH", "enum_globals", "enum_member", "load_deepspeed_file", "safe_enum_classes"]

# torch reads both `__builtin__ getattr` (pickle protocol 2, torch.save's) and `builtins getattr` as this
GETATTR_PATH = "builtins.getattr"


@functools.cache
def _allowlist() -> tuple[dict[type, type[enum.Enum]], list[tuple[type, str]]]:
    """(each class a checkpoint may name -> the Enum whose member names it accepts,
    the (class, pickled path) pairs to register)."""
    # imported on first use: the config modules bring in pydantic, which loading a zerospeed file
    # (plain types, no enums) does not need
    from torch.amp.grad_scaler import OptState

    from zerospeed.runtime.zero.config import ZeroStageEnum
    from zerospeed.runtime.zero.offload.config import OffloadDeviceEnum

    classes: dict[type, type[enum.Enum]] = {ZeroStageEnum: ZeroStageEnum, DeepSpeedZeroStage: ZeroStageEnum,
                                            OffloadDeviceEnum: OffloadDeviceEnum, OptState: OptState}
    # DeepSpeed's ZeroStageEnum path is DeepSpeedZeroStage's already, in DEEPSPEED_GLOBALS
    paths: list[tuple[type, str]] = [
        (ZeroStageEnum, "zerospeed.runtime.zero.config.ZeroStageEnum"),
        (OffloadDeviceEnum, "zerospeed.runtime.zero.offload.config.OffloadDeviceEnum"),
        (OffloadDeviceEnum, "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum"),
        (OptState, "torch.amp.grad_scaler.OptState")]
    return classes, paths


def safe_enum_classes() -> dict[type, type[enum.Enum]]:
    """Each class a checkpoint may name -> the Enum whose member names it accepts."""
    return _allowlist()[0]


def _describe(obj: object) -> str:
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def enum_member(owner: object, name: object) -> Any:
    """`getattr(owner, name)` for an allowlisted enum class and one of its member names; refuses
    everything else ([Note: getattr in weights-only loads])."""
    enum_class = safe_enum_classes().get(owner) if isinstance(owner, type) else None
    if (not isinstance(owner, type) or enum_class is None or type(name) is not str
            or name not in enum_class.__members__):
        allowed = ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in set(safe_enum_classes().values())))
        raise pickle.UnpicklingError(
            f"refusing getattr({_describe(owner)}, {name!r:.60}): a weights-only load allows getattr only to "
            f"read a member of an allowlisted enum ({allowed})")
    member = enum_class.__members__[name]
    return member if owner is enum_class else owner(member.value)   # a stand-in: built from the value


def enum_globals() -> list[tuple[Any, str]]:
    """The entries to add to torch's `safe_globals` next to DEEPSPEED_GLOBALS."""
    return [*_allowlist()[1], (enum_member, GETATTR_PATH)]


def load_deepspeed_file(path: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) with only DeepSpeed's four checkpoint classes allowed
    (deepspeed_compat.py), and allowlisted enum members by value or by name (above)."""
    with torch.serialization.safe_globals([*DEEPSPEED_GLOBALS, *enum_globals()]):  # type: ignore[arg-type]
        return to_plain_deepspeed(torch.load(path, map_location="cpu", weights_only=True, mmap=mmap))
