"""The one way tests run ranks: `run_on_ranks(fn, world_size, *args)`.

Each world size gets a pool of real worker processes (spawned, gloo, file-based rendezvous: no
ports), created on first use and reused by later tests so the suite does not pay for process
start-up and `import torch` every time. `fn` must be a module-level function (it is pickled by
name); it runs on every rank with the process group initialized and returns a picklable value.
The call returns the list of per-rank results.

A rank that raises makes `run_on_ranks` raise `RankError` with that rank's traceback; a rank
that calls `pytest.skip` skips the test. A timeout or an error kills the pool (the other ranks may
be stuck in a collective) and the next call builds a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 240.0
_SKIP = "__skip__"
_POLL_S = 1.0   # how often a waiting parent checks that every rank is alive


class RankError(RuntimeError):
    """A worker rank raised; the message holds its rank and traceback."""


def _worker_main(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world_size), ZS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        results.put((rank, *_run_task(fn, args, kwargs)))
    # Skip destroy_process_group: with gloo it intermittently aborts at exit (docs/testing.md).
    os._exit(0)


def _run_task(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[str, Any]:
    import torch

    torch.manual_seed(1234)
    try:
        value = fn(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
        if type(error).__name__ == "Skipped":
            return _SKIP, str(error)
        return "error", traceback.format_exc()
    try:
        # The queue pickles in a feeder thread that only prints a failure and drops the item, which
        # left the parent waiting out the whole timeout: pickle here and report it as this rank's error.
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any pickling failure is the test's error
        return "error", f"{fn.__name__} returned a value that cannot be sent back " \
                        f"({type(value).__name__}):\n{traceback.format_exc()}"
    return "ok", value


class _RankPool:
    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self._init_dir = tempfile.TemporaryDirectory(prefix="zs-rdzv-")
        init_file = os.path.join(self._init_dir.name, "rendezvous")
        self.results = context.Queue()
        self.task_queues = [context.Queue() for _ in range(world_size)]
        self.processes = [
            context.Process(target=_worker_main, daemon=True,
                            args=(rank, world_size, init_file, self.task_queues[rank], self.results))
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
        for task_queue in self.task_queues:
            task_queue.put((fn, args, kwargs))
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            try:
                # Short waits, so a rank that died without a result fails the test now, not at the deadline.
                rank, status, value = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive(outcomes)
                if time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                raise TimeoutError(f"{fn.__name__} timed out after {timeout_s:.0f}s on ranks {missing}") from None
            outcomes[rank] = (status, value)
            if status == "error":
                raise RankError(f"rank {rank} of {self.world_size} raised in {fn.__name__}:\n{value}")
            self._check_alive(outcomes)
        for status, value in outcomes.values():
            if status == _SKIP:
                import pytest

                pytest.skip(value)
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _check_alive(self, outcomes: dict[int, Any]) -> None:
        for rank, process in enumerate(self.processes):
            if rank not in outcomes and not process.is_alive():
                raise RankError(f"rank {rank} died with exit code {process.exitcode}")

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        self._init_dir.cleanup()


_pools: dict[int, _RankPool] = {}


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout_s)
    except (RankError, TimeoutError):
        shutdown_pool(world_size)
        raise


def shutdown_pool(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close()


def shutdown_all_pools() -> None:
    for world_size in list(_pools):
        shutdown_pool(world_size)
