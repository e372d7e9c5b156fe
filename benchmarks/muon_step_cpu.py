"""CPU time of zerospeed's Muon `engine.step()` on bench_muon.py's model, for a loaded machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/muon_step_cpu.py --stage 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/muon_step_cpu.py --stage 2 --profile   # + cProfile

2 CPU ranks x 1 thread (gloo), bench_muon.py's model and Muon config. Prints rank 0's process CPU
time (`time.process_time`: every thread of the process, the gloo transport's included) of each
measured `engine.step()`, their median and their minimum (load only adds time: the minimum is the steadier figure). CPU time is usable where wall time is not (other jobs
on the machine inflate it less, not at all); it still varies +-10% under heavy load, so compare
before / after interleaved. `--profile` adds a cProfile of one more step, sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_muon  # noqa: E402


def _rank(rank: int, init_file: str, args: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    import zerospeed

    torch.manual_seed(0)
    model = bench_muon.Model(256, 4)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=bench_muon._config("muon", args.stage, False))
    generator = torch.Generator().manual_seed(rank)

    def step(profiler: cProfile.Profile | None = None) -> float:
        tokens = torch.randint(0, bench_muon.VOCAB, (bench_muon.MICRO, bench_muon.SEQ), generator=generator)
        engine.backward(engine(tokens))
        torch.distributed.barrier()
        start = time.process_time()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        return time.process_time() - start

    for _ in range(args.warmup):
        step()
    cpu = [step() * 1e3 for _ in range(args.steps)]
    if rank == 0:
        print(f"stage {args.stage}: rank 0 engine.step() CPU ms: {' '.join(f'{c:.1f}' for c in cpu)}; "
              f"median {statistics.median(cpu):.1f}, min {min(cpu):.1f}")
    if args.profile:
        profiler = cProfile.Profile(time.process_time)
        step(profiler)
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    torch.multiprocessing.spawn(_rank, args=(init_file, args), nprocs=2)


if __name__ == "__main__":
    main()
