"""The examples' models, for the tests that train them.

`examples/` is not a package and is not installed, so nothing can `import` it by name; the tests
that train the example GPT load `examples/<name>.py` by path through this one function, and fail
with the path when it is missing instead of depending on a `sys.path` edit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

__all__ = ["EXAMPLES_DIR", "load_example"]


def load_example(name: str) -> ModuleType:
    """`examples/<name>.py` as a module (loaded once per process, under the name `example_<name>`)."""
    module_name = f"example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = os.path.join(EXAMPLES_DIR, f"{name}.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"the tests train the example model in {path}, which is missing")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module
