"""Reading a ds_config: a dict, a JSON/HJSON file path, or urlsafe-base64 JSON (`load_ds_config`)."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from typing import Any

import hjson

from zerospeed.runtime.config_utils import AUTO

__all__ = ["auto_key_paths", "load_ds_config"]


def load_ds_config(config: Any) -> dict[str, Any]:
    """A ds_config as a plain dict, from a dict, a JSON/HJSON file path, or urlsafe-base64 JSON."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, encoding="utf-8") as handle:
            return hjson.load(handle, object_pairs_hook=_reject_duplicates)
    if isinstance(config, str):
        try:
            decoded = base64.urlsafe_b64decode(config).decode("utf-8")
            loaded = json.loads(decoded, object_pairs_hook=_reject_duplicates)
        except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary or a valid "
                     f"base64. Received: {config}")


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
