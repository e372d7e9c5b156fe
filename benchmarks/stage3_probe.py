"""Where one system's step time and its jitter go: per-step phases, page faults, GC, RSS.

One run: the benchmark GPT in a wide-layer shape, 2 gloo ranks x 1 thread, the harness's data,
config and peers (`harness._build`), N steps. Per measured step and rank it records the wall time
of forward / backward / step, minor page faults (`ru_minflt`, every thread of the process),
involuntary context switches (foreign load shows up there), time spent in Python's garbage
collector, and the RSS high-water mark of each phase (reset through /proc/self/clear_refs).

    PYTHONPATH=$PWD python benchmarks/stage3_probe.py --model wide4 --steps 30
    PYTHONPATH=$PWD python benchmarks/stage3_probe.py --system deepspeed --stage 3
    PYTHONPATH=$PWD python benchmarks/stage3_probe.py --profile cprofile   # rank 0, measured steps

A/B of two source trees (each a directory holding `zerospeed/`), alternating ABBA so machine
noise hits both alike; each run is a fresh pair of processes importing that tree:

    python benchmarks/stage3_probe.py --trees /tmp/base $PWD --rounds 4 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from harness import RunSpec, _batches, _build, _CollectiveCounter, _ds_config, finish_rank, spawn_ranks

SHAPES = {  # GPT-2-style shapes of issue 21: (model, micro-batch)
    "wide4": (dict(n_layer=4, n_head=6, n_embd=384, block_size=128), 8),     # 7.25M params
    "wide10": (dict(n_layer=10, n_head=10, n_embd=640, block_size=256), 4),  # 49.6M params
}
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class _GCTimer:
    """Time spent in the cyclic garbage collector, through `gc.callbacks`."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start
            self.collections += 1


def _reset_hwm() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _hwm_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _counters(timer: _GCTimer) -> tuple[float, int, int, float, float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (time.perf_counter(), usage.ru_minflt, usage.ru_nivcsw, timer.total_s, time.thread_time(),
            time.process_time())


def _worker(rank: int, args: argparse.Namespace, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from gpt import GPT, GPTConfig

    shape, micro_batch = SHAPES[args.model]
    spec = RunSpec(system=args.system, stage=args.stage, model=args.model, steps=args.steps, warmup=args.warmup,
                   micro_batch=args.micro_batch or micro_batch, zero_overrides=json.loads(args.zero))
    torch.manual_seed(0)
    config = GPTConfig(**shape)
    model = GPT(config)
    if args.system == "zerospeed":  # as the harness, without the comms logger
        import zerospeed

        engine, _, _, _ = zerospeed.initialize(model=model, config=_ds_config(spec))
        forward, backward, step = engine, engine.backward, engine.step
    else:
        forward, backward, step = _build(spec, model, _CollectiveCounter(), lambda *args: None)
    timer = _GCTimer()
    profiler = _start_profiler(args.profile if rank == 0 else "none")
    rows = []
    loss = torch.zeros(())
    for index, (x, y) in enumerate(_batches(spec, rank, config.block_size)):
        if index == spec.warmup and args.gc_freeze:
            gc.collect()
            gc.freeze()
        if index == spec.warmup and profiler is not None:
            profiler.enable()
        marks, peaks = [_counters(timer)], []
        for phase in ("forward", "backward", "step"):
            _reset_hwm()
            if phase == "forward":
                loss = forward(x, y)
            elif phase == "backward":
                backward(loss)
            else:
                step()
            peaks.append(_hwm_mib())
            marks.append(_counters(timer))
        if index >= spec.warmup:
            rows.append({"phases_s": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
                         "thread_cpu_s": [b[4] - a[4] for a, b in zip(marks, marks[1:])],
                         "process_cpu_s": marks[-1][5] - marks[0][5],
                         "minflt": marks[-1][1] - marks[0][1], "nivcsw": marks[-1][2] - marks[0][2],
                         "gc_s": marks[-1][3] - marks[0][3], "peaks_mib": peaks})
    if profiler is not None:
        _report_profiler(profiler, args)
    summary = {"rank": rank, "steps": rows, "loss": float(loss.item()), "gc_collections": timer.collections,
               # the kernel's maxrss is VmHWM, which every phase resets: the measured steps' peak instead
               "maxrss_mib": max(max(row["peaks_mib"]) for row in rows)}
    finish_rank(results, summary)   # flushes the queue before os._exit (a lost result hung the parent)


def _start_profiler(kind: str) -> Any:
    if kind == "cprofile":
        import cProfile

        return cProfile.Profile(time.thread_time)  # CPU time of the main thread: robust to foreign load
    if kind == "faults":  # cProfile whose clock counts minor page faults: which function touches new pages
        import cProfile

        return cProfile.Profile(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 1.0)
    if kind == "torch":
        return _TorchProfiler()
    return None


class _TorchProfiler:
    def __init__(self) -> None:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def enable(self) -> None:
        self.prof.__enter__()

    def disable(self) -> None:
        self.prof.__exit__(None, None, None)


def _report_profiler(profiler: Any, args: argparse.Namespace) -> None:
    profiler.disable()
    out = sys.stderr
    if isinstance(profiler, _TorchProfiler):
        print(profiler.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40), file=out)
        return
    import pstats

    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)


def _summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Slowest rank's median / min step, median phases, per-step faults, GC, phase peaks."""
    def med(rank: dict[str, Any], key: Any) -> float:
        return statistics.median(key(row) for row in rank["steps"])

    steps = [[sum(row["phases_s"]) for row in rank["steps"]] for rank in per_rank]
    return {
        "step_median_s": max(statistics.median(s) for s in steps),
        "step_min_s": max(min(s) for s in steps),
        "phases_s": [max(med(r, lambda row, i=i: row["phases_s"][i]) for r in per_rank) for i in range(3)],
        "thread_cpu_s": [max(med(r, lambda row, i=i: row["thread_cpu_s"][i]) for r in per_rank) for i in range(3)],
        "process_cpu_s": max(med(r, lambda row: row["process_cpu_s"]) for r in per_rank),
        "minflt_per_step": max(med(r, lambda row: row["minflt"]) for r in per_rank),
        "nivcsw_per_step": max(med(r, lambda row: row["nivcsw"]) for r in per_rank),
        "gc_ms_per_step": 1e3 * max(statistics.mean(row["gc_s"] for row in r["steps"]) for r in per_rank),
        "phase_peak_mib": [max(max(row["peaks_mib"][i] for row in r["steps"]) for r in per_rank) for i in range(3)],
        "maxrss_mib": max(r["maxrss_mib"] for r in per_rank),
        "loss": per_rank[0]["loss"],
        "steps_s_rank0": [round(s, 4) for s in steps[0]],
        "minflt_by_rank": [[row["minflt"] for row in r["steps"]] for r in per_rank],
        "thread_cpu_by_rank": [[round(sum(row["thread_cpu_s"]), 3) for row in r["steps"]] for r in per_rank],
    }


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    per_rank = spawn_ranks(_worker, 2, args, label=f"{args.system} z{args.stage} {args.model}", num_results=2)
    return _summarize(sorted(per_rank, key=lambda r: r["rank"]))


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_ab(args: argparse.Namespace, passthrough: list[str]) -> None:
    """Alternate the trees ABBA over `rounds`; print each run and the medians per tree."""
    by_tree: dict[str, list[dict[str, Any]]] = {tree: [] for tree in args.trees}
    for round_index in range(args.rounds):
        order = args.trees if round_index % 2 == 0 else args.trees[::-1]
        for tree in order:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", *passthrough], env=env,
                                 check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            by_tree[tree].append(result)
            print(f"round {round_index} {tree}: median {result['step_median_s']:.3f} min {result['step_min_s']:.3f} "
                  f"phases {[round(p, 3) for p in result['phases_s']]} "
                  f"main-thread cpu {[round(p, 3) for p in result['thread_cpu_s']]} cpu {result['process_cpu_s']:.3f} minflt {result['minflt_per_step']:.0f} "
                  f"gc {result['gc_ms_per_step']:.1f} ms peak {result['maxrss_mib']:.0f} MiB "
                  f"(fwd / bwd / step {' / '.join(f'{p:.0f}' for p in result['phase_peak_mib'])}) load {_load()}",
                  flush=True)
    for tree, runs in by_tree.items():
        pick = {key: statistics.median(r[key] for r in runs) for key in
                ("step_median_s", "step_min_s", "process_cpu_s", "minflt_per_step", "gc_ms_per_step", "maxrss_mib")}
        phases = [round(statistics.median(r["phases_s"][i] for r in runs), 3) for i in range(3)]
        cpu = [round(statistics.median(r["thread_cpu_s"][i] for r in runs), 4) for i in range(3)]
        peaks = [round(statistics.median(r["phase_peak_mib"][i] for r in runs)) for i in range(3)]
        print(f"{tree}: " + " ".join(f"{k} {v:.3f}" for k, v in pick.items()) + f" phases {phases} main-thread cpu {cpu} phase peaks {peaks} "
              f"median/min {pick['step_median_s'] / pick['step_min_s']:.3f} loss {runs[0]['loss']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default="zerospeed", choices=["zerospeed", "deepspeed", "fsdp2", "ddp"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--model", choices=sorted(SHAPES), default="wide4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=0, help="0: the shape's own")
    parser.add_argument("--zero", default="{}", help="extra zero_optimization keys (JSON)")
    parser.add_argument("--profile", choices=["none", "cprofile", "faults", "torch"], default="none")
    parser.add_argument("--gc_freeze", action="store_true", help="gc.freeze() after the warm-up steps")
    parser.add_argument("--json", action="store_true", help="one JSON line (what --trees reads)")
    parser.add_argument("--trees", nargs="+", help="A/B: source trees to alternate (each holds zerospeed/)")
    parser.add_argument("--rounds", type=int, default=2)
    args, _ = parser.parse_known_args()
    if args.trees:
        argv = sys.argv[1:]
        skip = {"--trees", "--rounds"}
        passthrough, dropping = [], False
        for token in argv:
            if token.startswith("--"):
                dropping = token in skip
            if not dropping:
                passthrough.append(token)
        run_ab(args, passthrough)
        return
    result = run_once(args)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"load: {_load()}")


if __name__ == "__main__":
    main()
