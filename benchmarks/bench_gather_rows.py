"""The stages 1-2 post-step all-gather on gloo: `comm.all_gather_rows_in_place` against the chunked
`dist.all_gather` it replaced (issue 33), per call time and the freed heap left resident.

    python benchmarks/bench_gather_rows.py --numels 3630000 13250000 24800000 --calls 8

2 gloo ranks x 1 thread; for each row length n (the wide4 / vocab50k / wide10 partitions) each
form runs in fresh processes on a [2, n] fp32 buffer, the two forms alternated twice. Printed for
rank 0: ms per call and glibc's free heap after the calls (resident memory no tensor holds;
benchmarks/memory.py). The old form gathered 4M-element column chunks through gloo's all-gather,
whose staging buffer is allocated and freed on every call.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memory import malloc_heap_mib

OLD_CHUNK_NUMEL = 1 << 22


def _chunked_all_gather(rows: torch.Tensor) -> None:
    """The form before issue 33: column chunks through gloo's all-gather (input read first)."""
    chunk = OLD_CHUNK_NUMEL // rows.shape[0]
    for offset in range(0, rows.shape[1], chunk):
        columns = rows.narrow(1, offset, min(chunk, rows.shape[1] - offset))
        dist.all_gather(list(columns.unbind(0)), columns[dist.get_rank()])


def _worker(rank: int, form: str, numel: int, calls: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from zerospeed import comm

    # a freed block above glibc's 32 MiB cap raises the mmap threshold to it, as in a training process
    torch.empty(40 << 20, dtype=torch.uint8).fill_(0)
    rows = torch.randn(2, numel)
    gather = _chunked_all_gather if form == "chunked" else comm.all_gather_rows_in_place
    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        gather(rows)
        times.append(1000 * (time.perf_counter() - start))
    heap = malloc_heap_mib()
    if rank == 0:
        free = f"{heap[1]:.0f}" if heap is not None else "n/a"
        print(f"| {numel} | {form} | {min(times):.0f}-{max(times):.0f} | {free} |", flush=True)
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numels", type=int, nargs="+", default=[3_630_000, 13_250_000, 24_800_000])
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    print("| row numel | form | ms per call | heap free MiB after |\n|---|---|---|---|")
    for numel in args.numels:
        for form in ("chunked", "broadcast", "chunked", "broadcast"):
            with tempfile.TemporaryDirectory(prefix="zs-gather-") as tmp:
                mp.start_processes(_worker, args=(form, numel, args.calls, os.path.join(tmp, "rdzv")),
                                   nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
