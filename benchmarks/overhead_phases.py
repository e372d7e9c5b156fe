"""Per-phase CPU of one system's step, both ranks (issue 33): where a stage's CPU goes.

    python benchmarks/overhead_phases.py --model wide10 --steps 5 --warmup 2 --systems ddp zerospeed-z0 zerospeed-z2

Per rank and measured step (the harness's model, data and AdamW; 2 gloo ranks x 1 thread, fp32):
process CPU (`process_time`, every thread), the main thread's CPU (`thread_time`) in forward,
backward and step, the CPU of gloo's threads (process minus main thread), system time and minor
page faults (`os.times`, `getrusage`), and the main thread's CPU inside the runtime's hot-path
functions (gradient hooks and bucket copies, the reductions' launch and finish, the norm, the
optimizer update, the all-gather), counted by wrapping them with `thread_time` (CPU, not wall:
a rank blocked on a collective costs nothing here). Figures are means over the measured steps.
`--cprofile DIR` adds a per-function profile of rank 0's measured steps (cProfile on the
main thread's CPU clock).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import resource
import time
from typing import Any

import torch
import torch.distributed as dist

import harness
from harness import MICRO_BATCH, MODELS, RunSpec

# (module, class, method, label): the hot-path functions whose main-thread CPU is counted
HOT_PATH = [
    ("zerospeed.comm.in_flight", "InFlightQueue", "_finish_oldest", "finish reductions (wait + copy back / add)"),
    ("zerospeed.runtime.overlapped_allreduce", "OverlappedAllReduce", "mark_ready", "stage 0 hooks (count + launch)"),
    ("zerospeed.runtime.overlapped_allreduce", "OverlappedAllReduce", "_launch", "stage 0 bucket launch"),
    ("zerospeed.runtime.overlapped_allreduce", "OverlappedAllReduce", "finish", "stage 0 finish"),
    ("zerospeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_on_grad_ready",
     "stage 1/2 gradient hooks (all of them)"),
    ("zerospeed.runtime.zero.grad_buckets", "GradientBuckets", "add_grad", "stage 1/2 hooks (bucket copy + launch)"),
    ("zerospeed.runtime.zero.grad_buckets", "GradReducer", "reduce", "stage 1 slab reductions (launch)"),
    ("zerospeed.runtime.grad_space", "GradSpace", "scaled_norm", "norm"),
    ("zerospeed.runtime.data_parallel", "DataParallelOptimizer", "_apply_update", "update (optimizer step)"),
    ("zerospeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_apply_update",
     "update (optimizer step + all-gather)"),
    ("zerospeed.runtime.data_parallel", "DataParallelOptimizer", "zero_grad", "zero_grad"),
    ("zerospeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "zero_grad", "zero_grad"),
    ("zerospeed.runtime.data_parallel", "DataParallelOptimizer", "prepare_backward", "prepare_backward"),
    ("zerospeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "prepare_backward", "prepare_backward"),
    ("zerospeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "backward_epilogue",
     "stage 1/2 backward epilogue (boundary reduce)"),
    # stage 3 (they nest: a hook's fetch includes the coordinator's gathers and their waits)
    ("zerospeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_pre_forward",
     "z3 forward pre-hooks (fetch + wrap inputs)"),
    ("zerospeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "_post_forward",
     "z3 forward post-hooks (release + wrap outputs)"),
    ("zerospeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "pre_backward", "z3 backward pre-hooks (fetch)"),
    ("zerospeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "post_backward",
     "z3 backward post-hooks (release)"),
    ("zerospeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "fetch_sub_module",
     "z3 coordinator fetch (in the hooks)"),
    ("zerospeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "_prefetch",
     "z3 prefetch walk + launch (in fetch)"),
    ("zerospeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "_start_gather",
     "z3 gather launch (in fetch / refresh)"),
    ("zerospeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "_complete",
     "z3 gather wait + unpack (in fetch)"),
    ("zerospeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator",
     "release_sub_module", "z3 coordinator release (in the hooks)"),
    ("zerospeed.runtime.zero.stage3_gradients", "Stage3GradientReducer", "_on_grad_ready",
     "z3 gradient hooks (slab copy + launch)"),
    ("zerospeed.runtime.zero.stage3_gradients", "Stage3GradientReducer", "_store",
     "z3 reduced slab: average + add (in finish)"),
    ("zerospeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "backward_epilogue",
     "z3 backward epilogue (order check + last slab + release all)"),
    ("zerospeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_apply_update",
     "update (z3: optimizer step + persistent re-gather)"),
    ("zerospeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "refresh_persistent_parameters",
     "z3 persistent re-gather (in update)"),
    ("zerospeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "zero_grad", "zero_grad"),
]


def _count_cpu(totals: dict[str, float]) -> None:
    import importlib

    for module, cls_name, method, label in HOT_PATH:
        # a function a tree does not have is not counted (the script runs on older trees too)
        original = getattr(getattr(importlib.import_module(module), cls_name, None), method, None)
        if original is None:
            continue
        cls = getattr(importlib.import_module(module), cls_name)

        def timed(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.thread_time() - start
        setattr(cls, method, timed)


def _worker(rank: int, spec: RunSpec, cprofile_dir: str | None, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**MODELS[spec.model])
    totals: dict[str, float] = collections.defaultdict(float)
    if spec.system == "zerospeed":
        _count_cpu(totals)
    forward, backward, step = harness._build(spec, GPT(config), harness._CollectiveCounter(), lambda *_: None)
    sums: dict[str, float] = collections.defaultdict(float)
    profiler = cProfile.Profile(time.thread_time) if cprofile_dir and rank == 0 else None
    for index, (x, y) in enumerate(harness._batches(spec, rank, config.block_size)):
        if index == spec.warmup:
            totals.clear()
            if profiler is not None:   # on the measured steps: their figures include its cost
                profiler.enable()
        cpu0, main0, os0 = time.process_time(), time.thread_time(), os.times()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = forward(x, y)
        main1, faults1 = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        backward(loss)
        main2, faults2 = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        main3, cpu1, os1 = time.thread_time(), time.process_time(), os.times()
        if index >= spec.warmup:
            for key, value in (("process CPU", cpu1 - cpu0), ("main: forward", main1 - main0),
                               ("main: backward", main2 - main1), ("main: step", main3 - main2),
                               ("gloo threads", (cpu1 - cpu0) - (main3 - main0)),
                               ("system time", os1.system - os0.system),
                               ("faults: forward", faults1 - faults0), ("faults: backward", faults2 - faults1),
                               ("faults: step", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults2)):
                sums[key] += value
    num_steps = spec.steps - spec.warmup
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(cprofile_dir, f"{spec.label}.prof"))  # type: ignore[arg-type]
    figures = {k: v / num_steps for k, v in {**sums, **totals}.items()}
    harness.finish_rank(results, (spec.label, rank, figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="wide10")
    parser.add_argument("--systems", nargs="+", default=["ddp", "zerospeed-z0", "zerospeed-z1", "zerospeed-z2"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cprofile", metavar="DIR", help="also profile rank 0's measured steps with cProfile "
                        "(main-thread CPU clock): DIR/<system>.prof, and print its top functions by own time; "
                        "the other figures then include the profiler's cost")
    parser.add_argument("--top", type=int, default=30, help="functions printed per system with --cprofile")
    args = parser.parse_args()
    if args.cprofile:
        os.makedirs(args.cprofile, exist_ok=True)
    for text in args.systems:
        name, _, stage = text.partition("-z")
        spec = RunSpec(system=name, stage=int(stage or 0), model=args.model, steps=args.steps, warmup=args.warmup,
                       micro_batch=MICRO_BATCH.get(args.model, 4))
        for label, rank, figures in sorted(harness.spawn_ranks(_worker, 2, spec, args.cprofile, label=spec.label,
                                                               num_results=2)):
            print(f"{label} rank {rank}: " + ", ".join(
                f"{k} {v:.0f}" if k.startswith("faults") else f"{k} {v * 1e3:.0f} ms" for k, v in figures.items()),
                flush=True)
        if args.cprofile:
            stats = pstats.Stats(os.path.join(args.cprofile, f"{spec.label}.prof"))
            print(f"{spec.label} rank 0, cProfile over {spec.steps - spec.warmup} steps (main-thread CPU, s):")
            stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
