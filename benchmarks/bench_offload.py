"""ZeRO-Offload against DeepSpeed 0.19.8 with the same config, and the swap I/O engine against `dd`.

    DS_ACCELERATOR=cpu python benchmarks/bench_offload.py --model medium --rounds 2
    python benchmarks/bench_offload.py --cases z3-nvme --rounds 1 --io-mib 0     # one case, no disk part

Part 1, the training step. Each case is a ZeRO stage and an `offload_optimizer` device; zerospeed
and DeepSpeed run it with the same ds_config (benchmarks/harness.py: the GPT model, 2 gloo ranks x
1 thread, fresh processes per run, rounds alternating the order), both with their own fused CPU
Adam (`torch_adam: false`, what DeepSpeed builds for offload), swap files in a fresh directory
under `--nvme-dir`. Reported: median step wall time (and its forward / backward / `step()`
parts), peak RSS per rank, and the ratios.
DeepSpeed's stages 1 and 2 treat `nvme` as `cpu` (no swapping), so its z2-nvme row is a CPU
offload run; zerospeed swaps at every stage.

Part 2, the disk. The same `--io-mib` are written and read back sequentially by
  - `dd bs=1M oflag=direct` / `iflag=direct` (one process, O_DIRECT, as a `fio` sequential job),
  - zerospeed's `AsyncIOEngine` with the `aio` defaults, in swap-unit sized transfers submitted
    asynchronously (what the optimizer swapper does),
  - a bare loop of 1 MiB O_DIRECT `pwrite` / `preadv` calls into the same memory as the engine
    (dd reuses one 1 MiB buffer; distinct destination memory can be slower, see docs/benchmarks.md),
in alternation, best of `--io-rounds`; throughput in MB/s and zerospeed / dd.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict

from harness import MODELS, RunResult, RunSpec, median_results, run

DEFAULT_CASES = ["z2-cpu", "z3-cpu", "z2-nvme", "z3-nvme"]


def _spec(system: str, case: str, args: argparse.Namespace, nvme_root: str) -> RunSpec:
    stage_text, device = case.split("-")
    block: dict[str, object] = {"device": device}
    if device == "nvme":
        block["nvme_path"] = tempfile.mkdtemp(prefix=f"{system}-{case}-", dir=nvme_root)
        block["buffer_count"] = args.buffer_count
    zero = {"offload_optimizer": block, "sub_group_size": args.sub_group_size, **json.loads(args.zero)}
    return RunSpec(system=system, stage=int(stage_text[1:]), model=args.model, steps=args.steps,
                   warmup=args.warmup, micro_batch=args.micro_batch, zero_overrides=zero,
                   torch_adam=False, tag=device)


def training_table(args: argparse.Namespace) -> None:
    systems = ["zerospeed", "deepspeed"]
    collected: dict[str, list[RunResult]] = defaultdict(list)
    nvme_root = tempfile.mkdtemp(prefix="zs-offload-bench-", dir=args.nvme_dir)
    try:
        for round_index in range(args.rounds):
            pairs = [(s, c) for c in args.cases for s in systems]
            for system, case in pairs if round_index % 2 == 0 else reversed(pairs):
                spec = _spec(system, case, args, nvme_root)
                result = run(spec)
                shutil.rmtree(spec.zero_overrides["offload_optimizer"].get("nvme_path", ""), ignore_errors=True)
                collected[spec.label].append(result)
                print(f"round {round_index + 1}: {result}", flush=True)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    print(f"\nmodel={args.model} ({MODELS[args.model]}), 2 ranks x 1 thread, gloo, sub_group_size "
          f"{args.sub_group_size}, medians over {args.rounds} rounds")
    print("| case | zerospeed step s | DeepSpeed step s | step ratio | zerospeed peak RSS MiB | "
          "DeepSpeed peak RSS MiB | RSS ratio | zerospeed fwd / bwd / step s | DeepSpeed fwd / bwd / step s | "
          "final loss zs / DS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        ours, theirs = (median_results(collected[f"{s}-z{case[1]}-{case.split('-')[1]}"]) for s in systems)
        print(f"| {case} | {ours.step_s:.3f} | {theirs.step_s:.3f} | **{ours.step_s / theirs.step_s:.2f}** | "
              f"{ours.peak_rss_mib:.0f} | {theirs.peak_rss_mib:.0f} | **{ours.peak_rss_mib / theirs.peak_rss_mib:.2f}** | "
              f"{_phases(ours)} | {_phases(theirs)} | {ours.final_loss:.4f} / {theirs.final_loss:.4f} |")


def _phases(result: RunResult) -> str:
    return " / ".join(f"{seconds:.2f}" for seconds in result.phases_s)


# --- part 2: the disk -----------------------------------------------------------------------------

def _dd_seconds(args_list: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(["dd", *args_list], check=True, capture_output=True)
    return time.perf_counter() - started


def dd_throughput(path: str, mib: int) -> tuple[float, float]:
    """(write, read) MB/s of `dd` with 1 MiB O_DIRECT blocks."""
    write_s = _dd_seconds(["if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
    read_s = _dd_seconds([f"if={path}", "of=/dev/null", "bs=1M", f"count={mib}", "iflag=direct"])
    os.remove(path)
    return mib * 2**20 / write_s / 1e6, mib * 2**20 / read_s / 1e6


def engine_throughput(path: str, mib: int, unit_mib: int) -> tuple[float, float]:
    """(write, read) MB/s of `AsyncIOEngine`: `mib` in `unit_mib` transfers, all submitted at once
    (the engine's queue depth applies back-pressure), one file, aligned staging buffers."""
    import torch

    from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine, aligned_empty

    engine = AsyncIOEngine()   # the `aio` block's defaults
    unit_bytes = unit_mib * 2**20
    buffers = [aligned_empty(unit_bytes, torch.uint8).fill_(7) for _ in range(max(1, mib // unit_mib))]
    timings = []
    for submit in (engine.submit_write, engine.submit_read):
        started = time.perf_counter()
        futures = [submit(path, buffer, index * unit_bytes) for index, buffer in enumerate(buffers)]
        for future in futures:
            future.result()
        if submit == engine.submit_write:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        timings.append(time.perf_counter() - started)
    engine.shutdown()
    os.remove(path)
    total = len(buffers) * unit_bytes
    return total / timings[0] / 1e6, total / timings[1] / 1e6


def syscall_throughput(path: str, mib: int, unit_mib: int) -> tuple[float, float]:
    """(write, read) MB/s of a bare loop of 1 MiB O_DIRECT `pwrite` / `preadv` calls over the same
    destination memory as `engine_throughput`: the ceiling the engine's own work is measured by."""
    import torch

    from zerospeed.runtime.zero.offload.aio_engine import aligned_empty

    memory = aligned_empty(max(1, mib // unit_mib) * unit_mib * 2**20, torch.uint8).fill_(7)
    view = memoryview(memory.numpy()).cast("B")
    block, timings = 2**20, []
    for flags in (os.O_WRONLY | os.O_CREAT, os.O_RDONLY):
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        started = time.perf_counter()
        for offset in range(0, len(view), block):
            if flags == os.O_RDONLY:
                os.preadv(fd, [view[offset:offset + block]], offset)
            else:
                os.pwrite(fd, view[offset:offset + block], offset)
        os.fsync(fd)
        os.close(fd)
        timings.append(time.perf_counter() - started)
    os.remove(path)
    return len(view) / timings[0] / 1e6, len(view) / timings[1] / 1e6


def io_table(args: argparse.Namespace) -> None:
    directory = tempfile.mkdtemp(prefix="zs-io-bench-", dir=args.nvme_dir)
    runs = {"dd": lambda path: dd_throughput(path, args.io_mib),
            "zerospeed AsyncIOEngine": lambda path: engine_throughput(path, args.io_mib, args.io_unit_mib),
            "bare pwrite / preadv loop": lambda path: syscall_throughput(path, args.io_mib, args.io_unit_mib)}
    best = {name: [0.0, 0.0] for name in runs}
    try:
        for _ in range(args.io_rounds):
            for name, measure in runs.items():
                figures = measure(os.path.join(directory, "io.bin"))
                best[name] = [max(a, b) for a, b in zip(best[name], figures)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{args.io_mib} MiB sequential under {args.nvme_dir} ({_filesystem(args.nvme_dir)}), "
          f"best of {args.io_rounds}, engine transfers of {args.io_unit_mib} MiB")
    print("| writer / reader | write MB/s | read MB/s | write / dd | read / dd |")
    print("|---|---|---|---|---|")
    reference = best["dd"]
    for name, (write, read) in best.items():
        print(f"| {name} | {write:.0f} | {read:.0f} | {write / reference[0]:.2f} | {read / reference[1]:.2f} |")


def _filesystem(path: str) -> str:
    output = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return re.split(r"\s+", output[-1])[1] if len(output) > 1 else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="medium")
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="z<stage>-<cpu|nvme>")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--sub_group_size", type=int, default=4_000_000)
    parser.add_argument("--buffer_count", type=int, default=4)
    parser.add_argument("--zero", default="{}", help="more zero_optimization keys (JSON) for both systems")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where swap files and I/O tests go")
    parser.add_argument("--io-mib", type=int, default=1024, help="MiB for the disk part (0: skip it)")
    parser.add_argument("--io-unit-mib", type=int, default=64)
    parser.add_argument("--io-rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.cases:
        training_table(args)
    if args.io_mib:
        io_table(args)


if __name__ == "__main__":
    main()
