"""Submodules as attributes after a bare package import, loaded on first use.

DeepSpeed imports most of its tree in `import deepspeed`, so clients write attribute chains such as
`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` after a bare import. zerospeed keeps its
imports cheap instead and lets a package's `__getattr__` import the submodule on first access.
"""

from __future__ import annotations

import importlib.util

__all__ = ["find_submodule"]


def find_submodule(package: str, name: str) -> bool:
    """Whether `package.name` is a module that exists (without importing it)."""
    if name.startswith("__"):  # dunder lookups (copy, pickle, inspect) are never submodules
        return False
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except (ImportError, ValueError):
        return False
