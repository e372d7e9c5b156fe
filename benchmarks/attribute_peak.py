"""Where a training step's peak RSS comes from: peak resident memory inside chosen functions.

    python benchmarks/attribute_peak.py --model wide10 --system zerospeed-z1 --steps 3
    python benchmarks/attribute_peak.py --model wide10 --system deepspeed-z2 --probe \\
        deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.average_tensor

Runs the benchmark harness's model, data and ds_config (benchmarks/harness.py) on 2 gloo ranks,
with each probed function wrapped: on entry and exit the wrapper reads the kernel's high-water
mark (VmHWM) and resets it (benchmarks/memory.py), so every active frame, the three phases
included, learns the exact peak over its own duration, nested calls too. Printed for rank 0, per
probe: calls, RSS at entry of the call with the highest peak, that peak, and the difference (what
the call added on top of what it found), and the most glibc's heap grew inside one call (freed heap
stays resident: growth without live tensors is RSS that no tensor accounts for; issue 33).
Probing costs time; the figures here are memory only.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness
from memory import PeakRss, malloc_heap_mib

# module:qualname, patched where callers look them up
DEFAULT_PROBES = [
    "zerospeed.runtime.overlapped_allreduce:OverlappedAllReduce._launch",
    "zerospeed.runtime.overlapped_allreduce:OverlappedAllReduce.finish",
    "zerospeed.runtime.zero.grad_buckets:GradReducer.reduce",
    "zerospeed.runtime.zero.grad_buckets:GradReducer.reduce_to_owners",
    "zerospeed.runtime.zero.grad_buckets:GradReducer.wait_all",
    "zerospeed.runtime.zero.stage_1_and_2:reduce_flat_gradients",
    "zerospeed.runtime.grad_space:GradSpace.overflow",
    "zerospeed.runtime.grad_space:GradSpace.scaled_norm",
    "zerospeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._apply_update",
    "zerospeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._publish_params",
    "zerospeed.runtime.data_parallel:DataParallelOptimizer._apply_update",
    "torch.optim.adamw:AdamW.step",
]


class Frames:
    """The stack of active probed calls, each with the highest VmHWM seen during it."""

    def __init__(self) -> None:
        self.rss = PeakRss()
        self.stack: list[list[float]] = []  # [peak MiB] per active frame
        self.records: dict[str, tuple[int, float, float]] = {}  # name -> (calls, entry MiB, peak MiB)
        self.heap_growth: dict[str, float] = {}                  # name -> most heap MiB added by one call

    def _current_mib(self) -> float:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024.0

    def _observe(self) -> None:
        peak = self.rss.read_mib()
        for frame in self.stack:
            frame[0] = max(frame[0], peak)
        self.rss.reset()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._observe()
        entry, heap = self._current_mib(), malloc_heap_mib()
        self.stack.append([entry])
        try:
            return fn(*args, **kwargs)
        finally:
            self._observe()
            peak = self.stack.pop()[0]
            heap_after = malloc_heap_mib()
            if heap is not None and heap_after is not None:
                self.heap_growth[name] = max(self.heap_growth.get(name, 0.0), heap_after[0] - heap[0])
            calls, best_entry, best_peak = self.records.get(name, (0, 0.0, 0.0))
            if peak - entry > best_peak - best_entry:
                best_entry, best_peak = entry, peak
            self.records[name] = (calls + 1, best_entry, best_peak)


FRAMES = Frames()


def _install(spec: str) -> None:
    module_name, _, qualname = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    owner: Any = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, attr)

    @functools.wraps(original)
    def probed(*args: Any, **kwargs: Any) -> Any:
        return FRAMES.call(qualname, original, *args, **kwargs)

    setattr(owner, attr, probed)


def _worker(rank: int, spec: harness.RunSpec, probes: list[str], init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for probe in probes:
        _install(probe)
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**harness.MODELS[spec.model])
    forward, backward, step = harness._build(spec, GPT(config), harness._CollectiveCounter(), lambda *_: None)
    for x, y in harness._batches(spec, rank, config.block_size):
        loss = FRAMES.call("[forward]", forward, x, y)
        FRAMES.call("[backward]", backward, loss)
        FRAMES.call("[step]", step)
    if rank == 0:
        print(f"{spec.label} on {spec.model}, rank 0, {spec.steps} steps: peak RSS MiB inside each probe")
        print("| probe | calls | RSS at entry | peak | added | heap grown |\n|---|---|---|---|---|---|")
        for name, (calls, entry, peak) in FRAMES.records.items():
            grown = FRAMES.heap_growth.get(name)
            grown_text = "" if grown is None else f"{grown:+.0f}"
            print(f"| {name} | {calls} | {entry:.0f} | {peak:.0f} | {peak - entry:+.0f} | {grown_text} |")
        heap = malloc_heap_mib()
        if heap is not None:
            print(f"glibc heap after the last step: {heap[0]:.0f} MiB, of it free (resident) {heap[1]:.0f} MiB")
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(harness.MODELS), default="wide10")
    parser.add_argument("--system", default="zerospeed-z1", help="as benchmarks/run.py names them")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--probe", nargs="*", default=[], help="extra module:qualname to probe")
    parser.add_argument("--zero", default="{}", help="extra zero_optimization keys (JSON)")
    args = parser.parse_args()
    from run import parse_system

    args.warmup, args.micro_batch = 0, None
    spec = parse_system(args.system, args)
    with tempfile.TemporaryDirectory(prefix="zs-peak-") as tmp:
        mp.start_processes(_worker, args=(spec, DEFAULT_PROBES + args.probe, os.path.join(tmp, "rdzv")),
                           nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
