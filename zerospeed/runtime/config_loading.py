"""Reading a ds_config: a dict, a JSON/HJSON file path, or urlsafe-base64 JSON (`load_ds_config`)."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from typing import Any

import hjson

from zerospeed.runtime.config_utils import AUTO, ConfigError

__all__ = ["auto_key_paths", "load_ds_config"]


def load_ds_config(config: Any) -> dict[str, Any]:
    """A ds_config as a plain dict, from a dict, a JSON/HJSON file path, or urlsafe-base64 JSON.

    Files are read as HJSON, as DeepSpeed does (comments, unquoted keys and trailing commas are
    fine); a file that does not parse is one line naming the file, line and column.
    """
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        return _read_file(os.fspath(config))
    if isinstance(config, str) and config:
        try:
            decoded = base64.urlsafe_b64decode(config).decode("utf-8")
            loaded = json.loads(decoded, object_pairs_hook=_reject_duplicates)
        except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ConfigError(_bad_argument(config))


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = hjson.load(handle, object_pairs_hook=_reject_duplicates)
    except hjson.HjsonDecodeError as error:
        message = " ".join(str(error.msg).split())
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: the ds_config file does not parse: {message}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: the ds_config file is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except ValueError as error:  # duplicate keys
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a ds_config file must hold one JSON object, not {type(loaded).__name__}")
    return dict(loaded)


def _bad_argument(config: Any) -> str:
    """What was received and why it is not a ds_config (DeepSpeed prints only the value)."""
    expected = "pass a dict, the path of a JSON/HJSON file, or urlsafe-base64 JSON"
    if config is None:
        return f"no ds_config was given (config=None): {expected}"
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if not text:
            return f"the ds_config path is an empty string: {expected}"
        if os.path.isdir(text):
            return f"the ds_config path {text!r} is a directory, not a file"
        if isinstance(config, os.PathLike) or os.sep in text or text.endswith((".json", ".hjson", ".conf")):
            return f"ds_config file not found: {text!r} (working directory {os.getcwd()!r})"
        shown = text if len(text) <= 80 else text[:77] + "..."
        return f"the ds_config {shown!r} is neither an existing file nor base64-encoded JSON: {expected}"
    return f"a ds_config cannot be a {type(config).__name__}: {expected}"


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicates}")
    return dict(pairs)


def auto_key_paths(tree: Any, prefix: str = "") -> list[str]:
    """Every key path whose value is "auto" (reported, since DeepSpeed drops them silently)."""
    if not isinstance(tree, dict):
        return []
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths += [path] if value == AUTO else auto_key_paths(value, path + ".")
    return paths
