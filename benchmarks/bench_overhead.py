"""Runtime overhead per step: the CPU a rank spends outside torch kernels and collectives (issue 33).

    python benchmarks/bench_overhead.py --model wide10 --rounds 3 --steps 8 --warmup 2
    python benchmarks/bench_overhead.py --model wide4 --systems ddp zerospeed-z0 --rounds 1 --steps 4

Every system runs the harness's model, data and AdamW (harness.py), 2 gloo ranks x 1 thread, fp32,
in fresh processes; rounds alternate the order of the systems (reversed every other round).

Method. A step on a CPU rank runs forward, backward and the optimizer on the main thread (the
autograd engine runs CPU backward in the calling thread); gloo's collectives run on its own
threads, and waiting for them blocks without using CPU. So per step:
* `main CPU`: `time.thread_time()` of the main thread over the step, measured on steps run
  WITHOUT a profiler (`--steps` minus `--warmup`); `CPU` is the whole process (`process_time`).
* `kernels`, `copies`, `collectives`: on `--profile_steps` further steps, every torch op the main
  thread dispatches (the model's, the autograd engine's, DDP's C++ reducer's and the runtimes'
  Python alike) goes through a `TorchDispatchMode` that reads `time.thread_time()` around the
  op itself: the op's CPU time, not its wall time, so a loaded machine does not inflate it. The
  mode sees each op once, below autograd (a composite op's pieces, not the composite), so the
  times do not nest. Ops that move or convert data (copy_, cat, _to_copy, clone, fill_, zero_)
  are `copies`, `c10d` ops (a collective's launch and wait on this thread) `collectives`, every
  other op a `kernel`.
* `overhead = main CPU - kernels - collectives`: Python, hooks, dispatch and the copies (the
  issue counts bucket copies as runtime overhead: DDP makes the same copies, in C++), with
  `python+dispatch = overhead - copies`. Medians over steps, then over rounds; the slowest rank.
Caveats: the mode's own Python cost per op lands outside the op's interval and on steps that are
not the timed ones, so it is in no figure; thread CPU still varies with cache contention on a
shared machine, so compare systems within one run, on a quiet machine.
Goal (issue 33): each zerospeed stage's overhead <= DDP's + 5% (`vs DDP` column: overhead's
excess over DDP's as a share of DDP's CPU per step, and the ratio of the overheads).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import harness
from harness import MICRO_BATCH, MODELS, RunSpec

COPY_OPS = ("copy_", "cat", "_to_copy", "clone", "zero_", "fill_", "copy")
FIELDS = ("cpu", "main_cpu", "kernels", "copies", "collectives")


@dataclasses.dataclass
class Overhead:
    label: str
    figures: dict[str, float]    # per step, seconds: FIELDS

    @property
    def overhead(self) -> float:
        return self.figures["main_cpu"] - self.figures["kernels"] - self.figures["collectives"]


class _OpTimer(TorchDispatchMode):
    """Main-thread CPU seconds inside torch ops, by kind (the module docstring's `Method`)."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, float] = collections.defaultdict(float)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.thread_time()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.totals[_kind(func)] += time.thread_time() - start


def _kind(func: Any) -> str:
    namespace, name = func.namespace, func.__name__.split(".")[0]
    if namespace == "c10d":
        return "collectives"
    return "copies" if name in COPY_OPS else "kernels"


def _worker(rank: int, spec: RunSpec, profile_steps: int, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=spec.world_size)
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**MODELS[spec.model])
    forward, backward, step = harness._build(spec, GPT(config), harness._CollectiveCounter(), lambda *_: None)
    timed: dict[str, list[float]] = collections.defaultdict(list)
    batches = harness._batches(dataclasses.replace(spec, steps=spec.steps + profile_steps), rank, config.block_size)
    for index, (x, y) in enumerate(batches):
        if index < spec.steps:
            cpu0, main0 = time.process_time(), time.thread_time()
            backward(forward(x, y))
            step()
            if index >= spec.warmup:
                timed["cpu"].append(time.process_time() - cpu0)
                timed["main_cpu"].append(time.thread_time() - main0)
            continue
        with _OpTimer() as ops:
            backward(forward(x, y))
            step()
        for name in ("kernels", "copies", "collectives"):
            timed[name].append(ops.totals[name])
    stats = torch.tensor([statistics.median(timed[f]) if timed[f] else 0.0 for f in FIELDS], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(spec.world_size)]
    dist.all_gather(gathered, stats)
    slowest = max(gathered, key=lambda t: float(t[1]))   # the rank with the most main-thread CPU
    harness.finish_rank(results, Overhead(spec.label, dict(zip(FIELDS, slowest.tolist()))) if rank == 0 else None)


def _median(runs: list[Overhead]) -> Overhead:
    return Overhead(runs[0].label, {f: statistics.median(r.figures[f] for r in runs) for f in FIELDS})


def print_table(rows: list[Overhead]) -> None:
    ddp = next((r for r in rows if r.label == "ddp"), None)
    print("| system | CPU s | main CPU s | kernels s | collectives s | copies s | python+dispatch s "
          "| overhead s | overhead vs DDP: excess / DDP CPU, ratio |")
    print("|" + "---|" * 9)
    for row in rows:
        f = row.figures
        versus = "" if ddp is None or row is ddp else \
            f"{(row.overhead - ddp.overhead) / ddp.figures['cpu']:+.1%}, {row.overhead / ddp.overhead:.2f}x"
        print(f"| {row.label} | {f['cpu']:.3f} | {f['main_cpu']:.3f} | {f['kernels']:.3f} | {f['collectives']:.3f} "
              f"| {f['copies']:.3f} | {row.overhead - f['copies']:.3f} | {row.overhead:.3f} | {versus} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="wide10")
    parser.add_argument("--systems", nargs="+", default=["ddp", "zerospeed-z0", "zerospeed-z1", "zerospeed-z2",
                                                         "zerospeed-z3", "deepspeed-z0", "deepspeed-z1",
                                                         "deepspeed-z2", "deepspeed-z3"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="unprofiled steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile_steps", type=int, default=2)
    args = parser.parse_args()
    specs = []
    for text in args.systems:
        name, _, stage = text.partition("-z")
        specs.append(RunSpec(system=name, stage=int(stage or 0), model=args.model, steps=args.steps,
                             warmup=args.warmup, micro_batch=MICRO_BATCH.get(args.model, 4)))
    collected: dict[str, list[Overhead]] = collections.defaultdict(list)
    for round_index in range(args.rounds):
        for spec in specs if round_index % 2 == 0 else specs[::-1]:   # alternate against drift
            result = harness.spawn_ranks(_worker, spec.world_size, spec, args.profile_steps, label=spec.label)[0]
            collected[spec.label].append(result)
            print(f"round {round_index + 1}: {result.label} overhead {result.overhead:.3f} s/step "
                  f"{ {k: round(v, 3) for k, v in result.figures.items()} }", flush=True)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nmodel={args.model} ({MODELS[args.model]}), 2 ranks x 1 thread, gloo, fp32, AdamW; "
          f"{args.steps - args.warmup} timed + {args.profile_steps} profiled steps, medians over {args.rounds} "
          f"round(s), slowest rank; load average now {load}")
    print_table([_median(collected[s.label]) for s in specs])


if __name__ == "__main__":
    main()
