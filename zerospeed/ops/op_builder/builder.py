"""`OpBuilder`: how one native op is described, checked, compiled just in time and cached.

A builder names its C++ sources (inside the package, so a wheel carries them), include paths and
flags. `load()` returns the compiled Python module:

1. the module already loaded in this process, else
2. the shared object in the op's cache directory, imported without a compiler, else
3. a JIT build with `torch.utils.cpp_extension.load` (ninja) into that directory.

[Note: op cache key] The cache directory is `<root>/<name>_<key>`, where `key` hashes the source
and header bytes, the compiler flags (so the SIMD level), torch's version and the Python ABI:
what the binary's behaviour and interface depend on. The compiler is not part of it, so a cache
prebuilt in an image with a compiler loads where there is none. A change to any of them gets a fresh directory, never a stale `.so`; the same inputs
always find the earlier build, across processes and across ranks. `<root>` is `ZS_EXTENSIONS_DIR`,
else `TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`, each with a `zerospeed/` subfolder.
Prebuilding (`python -m zerospeed.ops.op_builder prebuild`) fills the same directories, and
`installed` in `zerospeed-report` means "a build for these exact inputs is in the cache".
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from zerospeed.ops.op_builder.cpu_features import detect_simd, simd_flags
from zerospeed.utils.logging import logger

__all__ = ["OpBuilder", "OpBuildError", "extensions_root"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # .../zerospeed


class OpBuildError(RuntimeError):
    """An op could not be loaded: incompatible host, no compiler or ninja, or a failed build."""


def extensions_root() -> Path:
    """Where built ops are cached (see [Note: op cache key])."""
    root = os.environ.get("ZS_EXTENSIONS_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "torch_extensions"
    return base / "zerospeed"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # the same choice torch.utils.cpp_extension makes


class OpBuilder(abc.ABC):
    """One native op. Subclasses set `NAME` and `BUILD_VAR` and list their sources."""

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]  # e.g. ZS_BUILD_CPU_ADAM: prebuild this op (default: ZS_BUILD_OPS)
    _loaded: ClassVar[dict[Path, ModuleType]] = {}  # per process, keyed by build directory

    def __init__(self) -> None:
        self.name = self.NAME
        self.error_log: str | None = None
        self.last_load_was_cache_hit: bool | None = None  # None until load() ran

    # What to build ------------------------------------------------------------------------

    def absolute_name(self) -> str:
        """DeepSpeed's import path of the prebuilt op, kept for tools that print it."""
        return f"zerospeed.ops.{self.NAME}_op"

    @abc.abstractmethod
    def sources(self) -> list[str]:
        """C++ sources, relative to the `zerospeed` package directory."""

    def include_paths(self) -> list[str]:
        return ["ops/csrc/includes"]

    def simd_level(self) -> str:
        return detect_simd(_compiler())

    def cxx_args(self) -> list[str]:
        # -ffp-contract=off: no implicit a*b+c -> fma fusion (the kernels write the fmas torch has, and
        # only those); -fno-math-errno: sqrt without an errno branch, so the loop vectorises.
        return ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-UC10_USE_GLOG",
                *simd_flags(self.simd_level())]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def absolute_sources(self) -> list[str]:
        return [str(_PACKAGE_ROOT / source) for source in self.sources()]

    def absolute_include_paths(self) -> list[str]:
        return [str(_PACKAGE_ROOT / path) for path in self.include_paths()]

    # Can it be built here ---------------------------------------------------------------------

    def incompatible_reason(self) -> str | None:
        """Why this op cannot be JIT-built on this host, or None when it can."""
        if sys.platform not in ("linux", "darwin"):
            return f"{self.NAME} is built for Linux and macOS only, not {sys.platform}"
        missing = [path for path in self.absolute_sources() if not os.path.isfile(path)]
        if missing:
            return f"sources missing from the install: {', '.join(missing)}"
        cxx = _compiler()
        if shutil.which(cxx.split()[0]) is None:
            return f"no C++ compiler: {cxx!r} (from $CXX, default c++) is not on PATH"
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            return "ninja is not available (pip install ninja): JIT builds need it"
        return None

    def is_compatible(self, verbose: bool = False) -> bool:
        self.error_log = self.incompatible_reason()
        if self.error_log and verbose:
            logger.warning(f"{self.NAME} is not compatible: {self.error_log}")
        return self.error_log is None

    # Cache ---------------------------------------------------------------------------------------

    def cache_key(self) -> str:
        digest = hashlib.sha256()
        files = sorted(self.absolute_sources())
        for include_dir in self.absolute_include_paths():
            files += sorted(str(p) for p in Path(include_dir).glob("*.h"))
        for path in files:
            digest.update(Path(path).name.encode())
            digest.update(Path(path).read_bytes() if os.path.isfile(path) else b"<missing>")
        inputs = [*self.cxx_args(), *self.extra_ldflags(), torch.__version__,
                  sysconfig.get_config_var("EXT_SUFFIX") or ""]
        digest.update("\0".join(inputs).encode())
        return digest.hexdigest()[:16]

    @property
    def extension_name(self) -> str:
        """The Python module name of the built library: prefixed, so it never collides with
        DeepSpeed's own `cpu_adam` & co. in `sys.modules` when both are loaded in one process."""
        return f"zerospeed_{self.NAME}"

    def build_dir(self) -> Path:
        return extensions_root() / f"{self.NAME}_{self.cache_key()}"

    def _built_library(self) -> Path | None:
        # torch's load() links `<name>.so`; its `lock` file means a build is still running.
        build_dir = self.build_dir()
        library = build_dir / f"{self.extension_name}.so"
        if library.is_file() and not (build_dir / "lock").exists():
            return library
        return None

    def is_installed(self) -> bool:
        """A build for exactly these sources, flags and torch is in the cache."""
        return self._built_library() is not None

    # Load --------------------------------------------------------------------------------------

    def load(self, verbose: bool = False) -> ModuleType:
        build_dir = self.build_dir()
        if build_dir in self._loaded:
            self.last_load_was_cache_hit = True
            return self._loaded[build_dir]
        library = self._built_library()
        if library is not None:
            module = self._import_library(library)
            self.last_load_was_cache_hit = True
        else:
            module = self.jit_load(verbose)
            self.last_load_was_cache_hit = False
        self._loaded[build_dir] = module
        return module

    def _import_library(self, library: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(self.extension_name, library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def jit_load(self, verbose: bool = False) -> ModuleType:
        if not self.is_compatible(verbose):
            raise OpBuildError(f"cannot build {self.NAME}: {self.error_log}")
        from torch.utils.cpp_extension import load

        build_dir = self.build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        try:
            module = load(name=self.extension_name, sources=self.absolute_sources(),
                          extra_include_paths=self.absolute_include_paths(),
                          extra_cflags=self.cxx_args(), extra_ldflags=self.extra_ldflags(),
                          build_directory=str(build_dir), verbose=verbose)
        except Exception as error:  # a compiler error: say which op, keep the compiler's message
            raise OpBuildError(f"building {self.NAME} in {build_dir} failed: {error}") from error
        logger.info(f"Time to load {self.NAME} op: {time.perf_counter() - started:.2f} seconds")
        return module
