"""The base of every ds_config section model, and how a bad config is reported.

Every section (``fp16``, ``zero_optimization``, ``offload_optimizer``, ...) is a
`DeepSpeedConfigModel`: a pydantic v2 model that forbids unknown keys, accepts a field's name and
its alias alike, and re-validates on assignment. Three input rules are applied before pydantic
sees a section, in `DeepSpeedConfigModel._prepare_input`:

* a value equal to the string ``"auto"`` is dropped so the field default applies (DeepSpeed's
  rule; the HF Trainer normally replaces them before we see them);
* a key listed in the class's ``deprecated_keys`` is renamed (or dropped) with a `ConfigWarning`;
* nothing else is forgiven: an unknown key or a value of the wrong type is an error.

A pydantic `ValidationError` never reaches the user. `validate_section` (config_keys.py) turns it into a
`ConfigError` with one line per problem, each naming the full key path
(``zero_optimization.offload_optimizer.devic``) and, for an unknown key, the closest valid key.
"""

from __future__ import annotations

import difflib
import types
import typing
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, model_validator

__all__ = [
    "AUTO",
    "ConfigError",
    "ConfigKeyError",
    "ConfigWarning",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "Deprecated",
    "model_in",
    "parse_dtype",
    "suggest_key",
    "warn_config",
]

AUTO = "auto"
ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A user mistake in a ds_config; the message names the key path."""


DeepSpeedConfigError = ConfigError


class ConfigWarning(UserWarning):
    """A ds_config key that was accepted but translated, ignored, or not implemented."""


class ConfigKeyError(ValueError):
    """Raised inside a validator about a key *below* the field being validated (e.g. a key of
    ``optimizer.params``); `validate_section` appends `key` to the reported path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class Deprecated(typing.NamedTuple):
    """``old_key -> new_key``; `convert` maps the old value to the new one (None: drop it)."""

    new_key: str | None
    convert: Callable[[Any], Any] = lambda value: value
    note: str = ""


def warn_config(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=3)


class DeepSpeedConfigModel(BaseModel):
    """Base of every ds_config section: strict keys, name or alias, validated assignment."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        populate_by_name=True,
        arbitrary_types_allowed=True,
        use_enum_values=False,
        protected_namespaces=(),
    )

    # Old spelling -> translation. Subclasses override.
    deprecated_keys: ClassVar[dict[str, Deprecated]] = {}

    @model_validator(mode="before")
    @classmethod
    def _prepare_input(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if not _is_auto(value)}
        for old_key, rule in cls.deprecated_keys.items():
            if old_key not in data:
                continue
            value = data.pop(old_key)
            new_value = rule.convert(value) if rule.new_key is not None else None
            where = f" Use '{rule.new_key}' instead." if rule.new_key else " It is ignored."
            warn_config(f"ds_config key '{old_key}' in {cls.__name__} is deprecated.{where} {rule.note}".rstrip())
            if rule.new_key is None or new_value is None:
                continue
            if rule.new_key in data:
                warn_config(f"both '{old_key}' and '{rule.new_key}' are set; keeping '{rule.new_key}'")
                continue
            data[rule.new_key] = new_value
        return data


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


# --------------------------------------------------------------------------------------------
# dtype names


_DTYPE_NAMES: dict[str, torch.dtype] = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32", "torch.float"), torch.float32),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16", "torch.half"), torch.float16),
    **dict.fromkeys(("bf16", "bfloat16", "bfloat", "torch.bfloat16"), torch.bfloat16),
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """A dtype spelled any way DeepSpeed's `DtypeEnum` accepts ("fp16", "half", "torch.bfloat16", ...)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    hint = suggest_key(str(value), _DTYPE_NAMES)
    raise ValueError(f"unknown dtype {value!r}; expected one of fp32, fp16, bf16 (or float32, half, "
                     f"bfloat16, torch.float16, ...){hint}")


# --------------------------------------------------------------------------------------------
# error reporting


def suggest_key(key: str, valid_keys: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest valid key, or "" when nothing is close."""
    matches = difflib.get_close_matches(key, list(valid_keys), n=1, cutoff=0.6)
    return f"; did you mean '{matches[0]}'?" if matches else ""


def valid_keys(model_cls: type[BaseModel]) -> list[str]:
    """Every spelling a model accepts: field names and all their aliases."""
    keys: list[str] = []
    for name, field in model_cls.model_fields.items():
        keys.append(name)
        if field.alias:
            keys.append(field.alias)
        if isinstance(field.validation_alias, AliasChoices):
            keys.extend(str(choice) for choice in field.validation_alias.choices)
        elif isinstance(field.validation_alias, str):
            keys.append(field.validation_alias)
    return list(dict.fromkeys(keys))


def _model_at(model_cls: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    """The sub-model class reached by following `loc` (field names or aliases) from `model_cls`."""
    current: type[BaseModel] | None = model_cls
    for part in loc:
        if current is None:
            return None
        field = next((f for n, f in current.model_fields.items() if part in _spellings(n, f)), None)
        if field is None:
            return None
        current = model_in(field.annotation)
    return current


def _spellings(name: str, field: Any) -> set[str]:
    names = {name, field.alias}
    if isinstance(field.validation_alias, AliasChoices):
        names.update(str(choice) for choice in field.validation_alias.choices)
    return names


def model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = model_in(arg)
            if found is not None:
                return found
    return None
