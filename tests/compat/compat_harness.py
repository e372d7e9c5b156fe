"""Run one user script on real DeepSpeed 0.19.8 and on zerospeed, side by side.

A compat script is written once against DeepSpeed's public API. It is a Python file defining

    def main(ds, ctx, **params) -> dict

where `ds` is the implementation under test (the `deepspeed` package, or `zerospeed`) and `ctx`
(`RankContext`) gives the rank, a shared work directory, `ctx.submodule("utils.zero_to_fp32")`
(the same dotted path in either package) and helpers that turn tensors into JSON. `main` returns
a JSON-serialisable dict; `run_script` returns one per rank. A script may import helper modules
that sit beside it (scripts/engine_kit.py, scripts/tiny_llama.py). An exception that escapes `main`
fails the run with every rank's traceback; a script that wants to compare error types catches
them itself (`ctx.error_name`).

Why not `tests/distributed.py`'s `run_on_ranks`: its pooled workers import one library into
long-lived processes and are reused across tests. Here two different libraries must each own
fresh processes (DeepSpeed patches torch and holds global state in `deepspeed.comm`; zerospeed
must not be imported next to it, or we could not tell which one a result came from), so each
run launches `world_size` new interpreters with `subprocess` (this file's `__main__`), joined
by a gloo file rendezvous (no ports). Start-up is slow (DeepSpeed's import takes seconds), so a
script should batch several checks into one run.

DeepSpeed runs with DS_ACCELERATOR=cpu. Its CPU ops JIT-build into the suite's own directory,
built once per session before the first launch (`tests/deepspeed_extensions.py` says why).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

IMPLS = ("deepspeed", "zerospeed")
IMPL_ENV = "ZS_COMPAT_IMPL"
DEEPSPEED_VERSION = "0.19.8"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TIMEOUT_S = 600.0

__all__ = ["IMPLS", "CompatRunError", "RankContext", "run_script", "run_both", "deepspeed_available",
           "require_deepspeed"]


class CompatRunError(RuntimeError):
    """A rank of a compat script failed; the message holds every rank's output."""


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def require_deepspeed() -> None:
    """Skip when DeepSpeed is missing on a developer machine; fail on CI (deepspeed_extensions)."""
    from deepspeed_extensions import require_deepspeed as require

    require()


# --- the parent side ---------------------------------------------------------------------------

def _rank_env(impl: str, rank: int, world_size: int) -> dict[str, str]:
    env = {**os.environ, IMPL_ENV: impl, "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    if impl == "deepspeed":
        from deepspeed_extensions import deepspeed_env  # parent side only: tests/ is on its path

        env.update(deepspeed_env())
    else:
        env["ZS_ACCELERATOR"] = "cpu"
    return env


def run_script(script: str, impl: str, workdir: str, world_size: int = 2,
               timeout_s: float = DEFAULT_TIMEOUT_S, **params: Any) -> list[dict[str, Any]]:
    """Run `script`'s `main(ds, ctx, **params)` on `world_size` fresh gloo ranks of `impl`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
    if impl == "deepspeed":
        from deepspeed_extensions import prepare_deepspeed_ops

        prepare_deepspeed_ops()
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"zs-compat-{impl}-") as scratch:
        spec = {"script": os.path.abspath(script), "workdir": os.path.abspath(workdir),
                "init_file": os.path.join(scratch, "rendezvous"), "params": params}
        spec_path = os.path.join(scratch, "spec.json")
        with open(spec_path, "w") as handle:
            json.dump(spec, handle)
        outs = [os.path.join(scratch, f"rank{rank}.json") for rank in range(world_size)]
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path, outs[rank]],
                                  env=_rank_env(impl, rank, world_size), cwd=spec["workdir"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world_size)]
        logs = _wait_all(procs, timeout_s)
        return _collect(impl, script, procs, logs, outs)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    logs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:   # the others may wait in a collective for the stuck rank
                other.kill()
            for other in procs:   # dead before the locks are judged: a dying holder still holds
                other.wait()
            from deepspeed_extensions import clear_stale_locks

            clear_stale_locks()   # a killed DeepSpeed rank may have held an op's build lock
            out, _ = proc.communicate()
            out += f"\n[compat harness] killed after {timeout_s:.0f}s"
        logs.append(out)
    return logs


def _collect(impl: str, script: str, procs: list[subprocess.Popen], logs: list[str],
             outs: list[str]) -> list[dict[str, Any]]:
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        if proc.returncode != 0 or not os.path.exists(out):
            report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{text[-6000:]}"
                               for r, (p, text) in enumerate(zip(procs, logs)))
            raise CompatRunError(f"{os.path.basename(script)} failed on {impl} rank {rank}:\n{report}")
        with open(out) as handle:
            results.append(json.load(handle))
    return results


def run_both(script: str, workdir: str, world_size: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
             impls: Iterable[str] = IMPLS, **params: Any) -> dict[str, list[dict[str, Any]]]:
    """`run_script` for each implementation at once (in `workdir/<impl>`); {impl: per-rank results}.

    Concurrent because most of a run is interpreter start-up and import, not compute."""
    impls = list(impls)
    with ThreadPoolExecutor(len(impls)) as pool:
        futures = {impl: pool.submit(run_script, script, impl, os.path.join(workdir, impl), world_size,
                                     timeout_s, **params) for impl in impls}
        return {impl: future.result() for impl, future in futures.items()}


# --- the rank side -----------------------------------------------------------------------------

class RankContext:
    """What a compat script gets besides the library: where it is, and JSON helpers."""

    def __init__(self, impl: str, workdir: str) -> None:
        self.impl = impl
        self.workdir = workdir
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])

    def submodule(self, dotted: str) -> Any:
        """`deepspeed.<dotted>` or `zerospeed.<dotted>`, whichever is under test."""
        return importlib.import_module(f"{self.impl}.{dotted}")

    def path(self, *parts: str) -> str:
        return os.path.join(self.workdir, *parts)

    @staticmethod
    def values(tensor: Any) -> list[float]:
        """A tensor's values, flattened, as float64 (exact for fp32 and bf16)."""
        return tensor.detach().double().flatten().tolist()

    @staticmethod
    def digest(tensor: Any) -> str:
        """sha256 of a tensor's bytes and dtype, for bit-for-bit comparisons of big tensors."""
        data = tensor.detach().cpu().contiguous()
        return hashlib.sha256(str(data.dtype).encode() + data.view(-1).view(__import__("torch").uint8)
                              .numpy().tobytes()).hexdigest()

    @staticmethod
    def error_name(fn: Any, *args: Any, **kwargs: Any) -> str | None:
        """Call fn; the name of the exception type it raised, or None."""
        try:
            fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the type is the result
            return type(error).__name__
        return None

    def files(self, root: str) -> list[str]:
        """Every file under `root`, relative and sorted."""
        found = []
        for dirpath, _, names in os.walk(root):
            found += [os.path.relpath(os.path.join(dirpath, name), root) for name in names]
        return sorted(found)


def _rank_main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    impl = os.environ[IMPL_ENV]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    ctx = RankContext(impl, spec["workdir"])
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=ctx.rank,
                            world_size=ctx.world_size)
    library = importlib.import_module(impl)
    # a script may import the helpers beside it; last, so that no script shadows an installed module
    sys.path.append(os.path.dirname(spec["script"]))
    script_spec = importlib.util.spec_from_file_location("compat_script", spec["script"])
    script = importlib.util.module_from_spec(script_spec)
    script_spec.loader.exec_module(script)
    result = script.main(library, ctx, **spec["params"])
    with open(out_path + ".tmp", "w") as handle:
        json.dump(result, handle)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    try:
        _rank_main(sys.argv[1], sys.argv[2])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    # Skip destroy_process_group: with gloo it intermittently aborts at exit (docs/testing.md).
    os._exit(0)
