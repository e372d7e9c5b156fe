"""Where a sequence-parallel training step's memory goes: live tensor bytes per phase and, at the
step's peak, which phase and op allocated each live byte. A companion of bench_sequence_parallel.py
(same model, same step), for attributing what does not shrink with sp.

    OMP_NUM_THREADS=1 python benchmarks/sp_memory_phases.py --sp 2 --length 8192

The CPU allocator reports every allocation and free to the profiler (``profile_memory=True``) with
the running total of live bytes, so the peak here is exact live tensor memory, unlike peak RSS
(which adds the interpreter, libraries, gloo and malloc's retained pages). Phases are
``record_function`` ranges; forward allocations are further labelled by the innermost module.
Run two lengths at each sp: what grows with length at sp 2 faster than half of sp 1's growth is
what is not sharded.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import resource
import sys
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sequence_parallel import VOCAB, _sp_engine  # noqa: E402

MIB = 1 << 20


def _label_modules(model: torch.nn.Module) -> None:
    """A ``record_function`` range per module (layer indices folded), so forward allocations name their module."""
    for name, module in model.named_modules():
        if not name:
            continue
        label = "mod:" + ".".join("*" if part.isdigit() else part for part in name.split("."))

        def pre(_m: Any, _a: Any, label: str = label) -> None:
            _m._zs_range = torch.autograd.profiler.record_function(label)
            _m._zs_range.__enter__()

        def post(_m: Any, _a: Any, _o: Any) -> None:
            _m._zs_range.__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def _labels(event: Any) -> tuple[str, str, str]:
    """(phase, innermost module label, the allocating op and its two callers) for an allocation event."""
    phase, module, ops = "?", "", []
    node = event.parent
    while node is not None:
        name = node.name
        if name.startswith("mod:"):
            module = module or name[4:]
        elif name.startswith("phase:"):
            phase = name[6:]
        elif len(ops) < 3 and not module:
            ops.append(name.replace("autograd::engine::evaluate_function: ", ""))
        node = node.parent
    return phase, module, " < ".join(ops)


def _walk(events: list[Any]) -> list[Any]:
    out, stack = [], list(events)
    while stack:
        event = stack.pop()
        out.append(event)
        stack.extend(event.children)
    return out


def attribute(prof: Any, top: int) -> dict:
    """Peak live bytes, per-phase peaks and, at the step's peak, the live bytes by (phase, module, op)."""
    allocs = [e for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if e.typed[0] == torch._C._profiler._EventType.Allocation and e.typed[1].device.type == "cpu"]
    allocs.sort(key=lambda e: e.start_time_ns)
    live: dict[int, tuple[int, tuple[str, str, str]]] = {}
    current = peak = 0
    peak_live: dict[int, tuple[int, tuple[str, str, str]]] = {}
    peak_at = ("", "", "")
    phase_peak: dict[str, int] = collections.defaultdict(int)
    for event in allocs:
        fields = event.typed[1]
        size = fields.alloc_size
        if size > 0:
            labels = _labels(event)
            live[fields.ptr] = (size, labels)
            current += size
            phase_peak[labels[0]] = max(phase_peak[labels[0]], current)
            if current > peak:
                peak, peak_live, peak_at = current, dict(live), labels
        else:
            freed = live.pop(fields.ptr, None)
            if freed is not None:
                current -= freed[0]
    by_label: collections.Counter = collections.Counter()
    for size, labels in peak_live.values():
        by_label[labels] += size
    return {"peak": peak, "peak_at": peak_at, "phase_peak": dict(phase_peak), "at_peak": by_label.most_common(top)}


def _worker(rank: int, world: int, init_file: str, length: int, hidden: int, layers: int, top: int, out: dict,
            profile: bool) -> None:
    engine, model, group = _sp_engine(rank, world, init_file, hidden, layers)
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    _label_modules(model)
    rss: dict[str, tuple[float, float]] = {}   # phase -> (RSS now, peak RSS so far) after it, MiB

    def phase(name: str) -> Any:
        return torch.autograd.profiler.record_function("phase:" + name)

    def mark(name: str) -> None:
        with open("/proc/self/statm") as statm:
            now = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        rss[name] = (now / MIB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    mark("setup")
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                if profile else contextlib.nullcontext())
    with profiler as prof:
        with phase("data"):
            ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
            labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            chunk = slice(rank * length // world, (rank + 1) * length // world)
            my_ids, my_labels, my_pos = ids[:, chunk], labels[:, chunk], torch.arange(length)[None, chunk]
        mark("data")
        with phase("forward"):
            logits = engine(input_ids=my_ids, position_ids=my_pos).logits
        mark("forward")
        with phase("loss"):
            loss = sequence_parallel_cross_entropy(logits, my_labels, group)
        mark("loss")
        del logits
        with phase("backward"):
            engine.backward(loss)
        mark("backward")
        with phase("step"):
            engine.step()
        mark("step")
    result = attribute(prof, top) if profile else {}
    result["rss"] = rss
    result["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out[rank] = result
    torch.distributed.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rss-only", action="store_true", help="no profiler: RSS after each phase only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(args.sp, os.path.join(tmp, "rdzv"), args.length, args.hidden, args.layers,
                                          args.top, out, not args.rss_only),
                           nprocs=args.sp, start_method="spawn", join=True)
        results = dict(out)
    for rank, result in sorted(results.items()):
        print(f"rank {rank}: peak RSS {result['rss_peak'] / MIB:.0f} MiB; RSS after each phase (now / peak so far): "
              + ", ".join(f"{k} {now:.0f}/{peak:.0f}" for k, (now, peak) in result["rss"].items()))
        if "peak" not in result:
            continue
        print(f"  peak live tensors {result['peak'] / MIB:.1f} MiB; per phase: "
              + ", ".join(f"{k} {v / MIB:.1f}" for k, v in result["phase_peak"].items()))
        print(f"  the peak is reached at: {' / '.join(result['peak_at'])}; live then:")
        for (phase, module, op), size in result["at_peak"]:
            print(f"  {size / MIB:8.2f} MiB  {phase:9s} {module:28s} {op}")

if __name__ == "__main__":
    main()
