"""The training runtime: engine, config, optimizers, ZeRO. Submodules load on first attribute access."""

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    from zerospeed.utils.lazy_modules import find_submodule

    if find_submodule(__name__, name):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
