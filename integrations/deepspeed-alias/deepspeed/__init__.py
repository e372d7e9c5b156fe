"""`deepspeed` as an alias of zerospeed (installed on purpose: see docs/integrations.md).

Importing this package replaces itself in `sys.modules` with the `zerospeed` package and puts a
finder in front of `sys.meta_path` that answers every `deepspeed.a.b` import with the module
object `zerospeed.a.b` (imported once, under its own name). So `deepspeed.runtime.engine.
DeepSpeedEngine is zerospeed.runtime.engine.DeepSpeedEngine`, and a client's monkeypatch of
`deepspeed.x.y.name` lands on zerospeed's module. This file maps names only; it holds no behaviour.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

ALIAS, TARGET = "deepspeed", "zerospeed"

# DeepSpeed modules whose feature zerospeed does not have yet: importing them names the feature
# instead of a bare "No module named ..." (clients import them only once they switched it on).
MISSING_FEATURES = {
    "deepspeed.module_inject": "kernel injection and AutoTP",
    "deepspeed.inference.v2": "DeepSpeed FastGen (inference v2)",
    "deepspeed.compile": "DeepCompile",
}


class AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.x` by returning the module `zerospeed.x` itself."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the target module is already executed."""

    def get_code(self, fullname: str):  # `python -m deepspeed.launcher.runner` runs zerospeed's code
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec is not None and spec.loader is not None else None


class MissingFeatureLoader(importlib.abc.Loader):
    def __init__(self, name: str, feature: str) -> None:
        self.name, self.feature = name, feature

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        raise ImportError(f"{self.name}: zerospeed (standing in for DeepSpeed through the `deepspeed` alias) "
                          f"does not implement {self.feature} yet; turn that feature off in the client "
                          "library's configuration, or use the real DeepSpeed", name=self.name)

    def exec_module(self, module: ModuleType) -> None:
        """Never reached: create_module raised."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `deepspeed.*` names as the `zerospeed.*` modules of the same path."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        try:
            real_spec = sys.modules[real].__spec__ if real in sys.modules else importlib.util.find_spec(real)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            feature = _missing_feature(fullname)
            if feature is None:
                return None
            return importlib.machinery.ModuleSpec(fullname, MissingFeatureLoader(fullname, feature))
        spec = importlib.machinery.ModuleSpec(fullname, AliasLoader(real), origin=real_spec.origin,
                                              is_package=real_spec.submodule_search_locations is not None)
        return spec


def _missing_feature(fullname: str) -> str | None:
    for prefix, feature in MISSING_FEATURES.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            return feature
    return None


def _warn_if_shadowing() -> None:
    """Say so when a real DeepSpeed is installed further down sys.path: this alias hides it."""
    from importlib.metadata import distributions

    for dist in distributions(name=ALIAS):
        if "zerospeed" not in (dist.version or ""):
            warnings.warn(f"the `deepspeed` alias gives zerospeed; the real DeepSpeed {dist.version} installed at "
                          f"{dist.locate_file('')} is hidden behind it (remove this alias from the path, or "
                          "`pip uninstall deepspeed`, to use DeepSpeed again)", stacklevel=3)
            return


def _install() -> ModuleType:
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
    _warn_if_shadowing()
    zerospeed = importlib.import_module(TARGET)
    sys.modules[ALIAS] = zerospeed  # the import statement returns what sys.modules holds
    return zerospeed


_install()
