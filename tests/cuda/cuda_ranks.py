"""`run_nccl(fn, world_size, *args)`: `fn` on `world_size` fresh processes, one GPU each, NCCL.

The CPU suite's `tests/distributed.py` pins gloo and the CPU accelerator; this is its GPU
counterpart: rank r uses `cuda:r`, `ZS_ACCELERATOR=cuda`, a file rendezvous (no ports). `fn` is a
module-level function returning something picklable without CUDA (move tensors to the CPU).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["gpu_world_sizes", "run_nccl"]


def gpu_world_sizes() -> list[int]:
    """1, plus every GPU when there are more (the multi-rank runs a bigger machine adds)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [1] + ([count] if count > 1 else [])


def _worker(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world_size), ZS_ACCELERATOR="cuda", DS_ACCELERATOR="cuda")
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 comparisons need real fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    try:
        torch.manual_seed(1234)
        outcome = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    results.put((rank, outcome))
    dist.barrier()
    dist.destroy_process_group()


def run_nccl(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="zs-nccl-") as tmp:
        procs = [context.Process(target=_worker, args=(r, world_size, os.path.join(tmp, "rdzv"), fn, args, results))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        outcomes: dict[int, Any] = {}
        try:
            while len(outcomes) < world_size:
                rank, outcome = results.get(timeout=timeout_s)
                outcomes[rank] = outcome
        except queue.Empty:
            raise TimeoutError(f"{fn.__name__}: {world_size - len(outcomes)} rank(s) gave no result "
                               f"in {timeout_s:.0f}s") from None
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    errors = [f"--- rank {r} ---\n{o[1]}" for r, o in sorted(outcomes.items()) if o[0] == "error"]
    if errors:
        raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
    return [outcomes[r][1] for r in range(world_size)]
