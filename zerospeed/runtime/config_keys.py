"""The key rules applied to a raw ds_config before pydantic sees it (`prepare_tree`).

Clients add keys DeepSpeed never defined, and DeepSpeed itself ignores any key it does not read.
zerospeed is stricter about typos and more forgiving about additions:

* a DeepSpeed section zerospeed does not implement is refused or dropped with a warning, by the
  section's own rule (config_unimplemented, applied first, at the top level);
* an unknown key that is a near-miss of a real key of its section (``"stage3_prefech_bucket_size"``)
  is an error with a did-you-mean (pydantic reports it: the key is left in place), unless it is
  itself a key real configs carry that DeepSpeed ignores (``"comms_config"``, the model's
  ``known_elsewhere_keys``);
* any other unknown key (``"msamp"``, a newer DeepSpeed key) is dropped with one warning naming
  its path, so a client's addition never breaks a run;
* a dotted top-level key (TRL sends ``"zero_optimization.reduce_bucket_size"``) is applied as the
  nested key it names, with one warning (DeepSpeed silently ignores it); an explicit nested value
  other than ``"auto"`` wins;
* a string where the key takes a number or a boolean (``"2"``, ``"yes"``) is an error naming the
  key, where pydantic (and DeepSpeed) would convert it silently. ``"auto"`` is the one string
  accepted anywhere (dropped, so the default applies; `DeepSpeedConfigModel._prepare_input`).
"""

from __future__ import annotations

import types
import typing
from enum import IntEnum
from typing import Any

from pydantic import BaseModel, ValidationError

from zerospeed.runtime.config_utils import (
    AUTO,
    ConfigError,
    ConfigKeyError,
    ModelT,
    _model_at,
    model_in,
    suggest_key,
    valid_keys,
    warn_config,
)

__all__ = ["apply_dotted_keys", "prepare_tree", "validate_section"]

_SCALARS = (int, float, bool)


def prepare_tree(model_cls: type[BaseModel], data: Any, path: str = "") -> Any:
    """`data` with unknown keys dropped (warned) and dotted keys applied; string-for-number errors raised."""
    problems: list[str] = []
    prepared = _prepare(model_cls, data, path, problems)
    if problems:
        raise ConfigError("Invalid DeepSpeed config:\n  " + "\n  ".join(problems))
    return prepared


def _prepare(model_cls: type[BaseModel], data: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        return data
    if not path:
        data = apply_dotted_keys(model_cls, data)
        screen = getattr(model_cls, "screen_top_level", None)
        if screen is not None:  # DeepSpeed sections zerospeed does not implement: refused or dropped
            data = screen(data, problems)
    fields = _fields_by_spelling(model_cls)
    accepted = set(getattr(model_cls, "deprecated_keys", {})) | set(getattr(model_cls, "accepted_keys", ()))
    known_elsewhere = getattr(model_cls, "known_elsewhere_keys", {})
    out: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        field = fields.get(key)
        if field is None:
            if key in known_elsewhere:
                warn_config(f"ds_config key '{key_path}' is ignored: DeepSpeed does not read it either "
                            f"(it comes from {known_elsewhere[key]})")
            elif key in accepted or suggest_key(str(key), [*fields, *accepted]):
                out[key] = value  # translated by the model, or a typo pydantic reports with did-you-mean
            else:
                warn_config(f"ds_config key '{key_path}' is not a key zerospeed knows; it is ignored")
            continue
        sub_model = model_in(field.annotation)
        if sub_model is not None and isinstance(value, dict):
            value = _prepare(sub_model, value, key_path, problems)
        elif isinstance(value, str) and value != AUTO and _is_scalar(field.annotation):
            problems.append(f"{key_path}: expected {_kind(field.annotation)}, got the string {value!r}")
        out[key] = value
    return out


def apply_dotted_keys(model_cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}`` for a top-level key naming a nested key of `model_cls`."""
    fields = _fields_by_spelling(model_cls)
    out = dict(data)
    for key in [k for k in data if isinstance(k, str) and "." in k and k not in fields]:
        section, _, rest = key.partition(".")
        if section not in fields or "." in rest or not isinstance(out.get(section, {}), dict):
            continue  # not a section.key pair: left for the unknown-key rule
        value = out.pop(key)
        nested = dict(out.get(section) or {})
        explicit = nested.get(rest)
        if explicit is not None and explicit != AUTO and explicit != value:
            warn_config(f"ds_config key '{key}' is ignored: '{section}' sets '{rest}' to {explicit!r}")
            continue
        section_model = model_in(fields[section].annotation)
        nested[rest] = _as_field_type(section_model, rest, value)
        out[section] = nested
        if section_model is not None and rest in _fields_by_spelling(section_model):
            warn_config(f"ds_config key '{key}' applied as {section}.{rest} = {nested[rest]!r} "
                        "(DeepSpeed ignores dotted keys)")
        # else: the nested unknown-key rule warns (or fails with did-you-mean) about section.rest
    return out


def _as_field_type(model_cls: type[BaseModel] | None, key: str, value: Any) -> Any:
    """An int field given a fractional float (TRL sends 0.9 * hidden^2): truncate, as transformers does."""
    if model_cls is None or not isinstance(value, float) or value.is_integer():
        return value
    field = _fields_by_spelling(model_cls).get(key)
    return int(value) if field is not None and _scalar_types(field.annotation) == {int} else value


def _fields_by_spelling(model_cls: type[BaseModel]) -> dict[str, Any]:
    by_name = {}
    for name, field in model_cls.model_fields.items():
        for spelling in _spellings(name, field):
            by_name[spelling] = field
    return by_name


def _spellings(name: str, field: Any) -> list[str]:
    from pydantic import AliasChoices

    names = [name] + ([field.alias] if field.alias else [])
    if isinstance(field.validation_alias, AliasChoices):
        names += [str(choice) for choice in field.validation_alias.choices]
    elif isinstance(field.validation_alias, str):
        names.append(field.validation_alias)
    return names


def _scalar_types(annotation: Any) -> set[type] | None:
    """{int}, {float, int}, {bool}... when `annotation` is only numbers/booleans (and None); else None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found: set[type] = set()
        for arg in typing.get_args(annotation):
            if arg is type(None):
                continue
            inner = _scalar_types(arg)
            if inner is None:
                return None
            found |= inner
        return found or None
    if isinstance(annotation, type) and issubclass(annotation, IntEnum):
        return {int}  # ZeroStageEnum: pydantic would take "2" for stage 2 (DeepSpeed does)
    return {annotation} if annotation in _SCALARS else None


def _is_scalar(annotation: Any) -> bool:
    return _scalar_types(annotation) is not None


def _kind(annotation: Any) -> str:
    kinds = _scalar_types(annotation) or set()
    return "a boolean (true/false)" if kinds == {bool} else "a number"


def validate_section(model_cls: type[ModelT], data: Any, path: str = "") -> ModelT:
    """Validate `data` as `model_cls`; any problem becomes one `ConfigError` listing every key path.

    The key rules of config_keys (unknown keys, dotted keys, strings for numbers) run first."""
    data = prepare_tree(model_cls, {} if data is None else data, path)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(model_cls, error, path) for error in exc.errors()]
        raise ConfigError("Invalid DeepSpeed config:\n  " + "\n  ".join(lines)) from None


def _describe(model_cls: type[BaseModel], error: Any, prefix: str) -> str:
    loc = [str(part) for part in error["loc"]]
    exc = (error.get("ctx") or {}).get("error")
    if isinstance(exc, ConfigKeyError):
        loc.append(exc.key)
    key_path = ".".join(([prefix] if prefix else []) + loc) or "ds_config"
    if error["type"] == "extra_forbidden":
        owner = _model_at(model_cls, loc[:-1])
        hint = suggest_key(loc[-1], valid_keys(owner)) if owner is not None else ""
        section = ".".join(([prefix] if prefix else []) + loc[:-1]) or "the top level"
        return f"{key_path}: unknown key in {section}{hint}"
    message = str(error["msg"])
    for noise in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(noise)
    given = error.get("input")
    shown = "" if error["type"] in ("value_error", "assertion_error") or isinstance(given, dict) else f" (got {given!r})"
    return f"{key_path}: {message}{shown}"
