"""Where real DeepSpeed (the reference side of tests/compat and tests/integrations) builds its
CPU ops, and why a build lock can never hang the suite.

DeepSpeed 0.19.8 on the CPU accelerator JIT-builds ops with torch.utils.cpp_extension: the shared
memory collective op at `init_distributed`, cpu_adam when an offloaded or CPU Adam is used. Every
load, even of an op built long ago, takes a file lock (`<op>/lock`, torch's FileBaton) and waits
for it without a timeout. A process killed while holding it (a timed-out test, a rank killed when
its peer failed) leaves the lock behind, and every later DeepSpeed launch then waits forever; and
several launches started together on a fresh machine all compile at once on two cores.

So the suite pins one directory of its own, clears the stale locks in it at the start of each
session and after killing a launch, and builds the collective op once, before any side-by-side
launch. Stale means the holder is dead (build_locks.py): concurrent pytest sessions of one user
share the directory, and another session's live build keeps its lock.
`ZS_COMPAT_EXTENSIONS_DIR` overrides the directory.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading

from build_locks import remove_stale_locks

DEEPSPEED_VERSION = "0.19.8"
EXTENSIONS_DIR = os.environ.get("ZS_COMPAT_EXTENSIONS_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "torch_extensions", f"deepspeed-{DEEPSPEED_VERSION}")
PREBUILD_TIMEOUT_S = 900
_prepared = False
_prepare_lock = threading.Lock()  # side-by-side runs start from two threads at once

# Only the op every launch loads (at init_distributed); cpu_adam and the others build when a run
# first needs them, one process building while the others wait.
_PREBUILD = ("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
             "ShareMemCommBuilder().load(verbose=False)\n")

__all__ = ["EXTENSIONS_DIR", "clear_stale_locks", "deepspeed_env", "import_deepspeed", "prepare_deepspeed_ops",
           "require_deepspeed"]


def require_deepspeed() -> None:
    """Skip (naming the package) when DeepSpeed is not installed on a developer machine; fail on CI.

    CI (env CI set) installs deepspeed==0.19.8, so a missing DeepSpeed there is a broken setup,
    never a reason to skip silently."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("deepspeed") is not None:
        return
    message = (f"deepspeed=={DEEPSPEED_VERSION} is not importable; install it with "
               f"`pip install --no-build-isolation deepspeed=={DEEPSPEED_VERSION}` (make test does)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message, allow_module_level=True)


def import_deepspeed(module: str):  # noqa: ANN201 - a module of the optional reference package
    """`deepspeed.<...>` for a side-by-side test. Only a missing DeepSpeed skips (`require_deepspeed`);
    an installed DeepSpeed whose module fails to import fails the test (`pytest.importorskip` would
    skip on any ImportError and hide it)."""
    import importlib

    require_deepspeed()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return importlib.import_module(module)


def deepspeed_env() -> dict[str, str]:
    """What a process running real DeepSpeed on CPU needs in its environment."""
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": EXTENSIONS_DIR}


def clear_stale_locks() -> list[str]:
    """Remove the build locks under EXTENSIONS_DIR whose holder has died; a lock some live process
    holds (this session's or another's) stays. After killing a launch, wait for its processes to
    be gone first: a dying holder still holds."""
    return remove_stale_locks(glob.glob(os.path.join(EXTENSIONS_DIR, "*", "lock")))


def prepare_deepspeed_ops() -> None:
    """Once per session: clear stale locks, then build DeepSpeed's CPU ops in one process."""
    global _prepared
    with _prepare_lock:
        if not _prepared:
            _build_ops()
            _prepared = True


def _build_ops() -> None:
    clear_stale_locks()
    os.makedirs(EXTENSIONS_DIR, exist_ok=True)
    env = {**os.environ, **deepspeed_env()}
    try:
        proc = subprocess.run([sys.executable, "-c", _PREBUILD], env=env, capture_output=True, text=True,
                              timeout=PREBUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        clear_stale_locks()
        raise RuntimeError(f"building DeepSpeed's CPU ops in {EXTENSIONS_DIR} took over "
                           f"{PREBUILD_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"building DeepSpeed's CPU ops in {EXTENSIONS_DIR} failed:\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
