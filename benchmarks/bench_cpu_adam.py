"""Parameters updated per second by the fused CPU Adam vs torch AdamW, and vs memory bandwidth.

    python benchmarks/bench_cpu_adam.py [--sizes 1M 16M 128M] [--threads 1 2] [--steps 20] [--deepspeed]

Every optimizer updates the same single flat fp32 parameter. The bound: an fp32 Adam step reads
param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes per parameter,
so at a copy bandwidth B (measured here with a large tensor copy) no step can beat B / 28
parameters per second. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from zerospeed.ops.adam import DeepSpeedCPUAdam

BYTES_PER_PARAM = 28


def _parse_size(text: str) -> int:
    return int(float(text.rstrip("M")) * (1 << 20)) if text.endswith("M") else int(text)


def _best_seconds(fn, steps: int) -> float:
    fn()  # warm up: state allocation, first-touch page faults, thread pool start
    best = float("inf")
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def copy_bandwidth_bytes_per_s(numel: int = 64 << 20, steps: int = 10) -> float:
    src, dst = torch.ones(numel), torch.empty(numel)
    return 2 * 4 * numel / _best_seconds(lambda: dst.copy_(src), steps)  # read + write


def _optimizers(param: torch.nn.Parameter, with_deepspeed: bool) -> dict[str, torch.optim.Optimizer]:
    optimizers = {
        "torch AdamW fused": torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True),
        "torch AdamW foreach": torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, foreach=True),
        "zerospeed DeepSpeedCPUAdam": DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01),
    }
    if with_deepspeed:  # DeepSpeed 0.19.8's own op (JIT-built on first use; the `bench` extra)
        from deepspeed.ops.adam import DeepSpeedCPUAdam as DeepSpeedsCPUAdam

        optimizers["DeepSpeed 0.19.8 DeepSpeedCPUAdam"] = DeepSpeedsCPUAdam([param], lr=1e-3, weight_decay=0.01)
    return optimizers


def run(sizes: list[int], threads: list[int], steps: int, with_deepspeed: bool = False) -> None:
    print("| threads | params | optimizer | ms/step | Mparams/s | x torch fused | of 28 B/param bound |")
    print("|---|---|---|---|---|---|---|")
    for num_threads in threads:
        torch.set_num_threads(num_threads)
        bandwidth = copy_bandwidth_bytes_per_s()
        bound = bandwidth / BYTES_PER_PARAM
        print(f"| {num_threads} | copy | bandwidth {bandwidth / 1e9:.1f} GB/s | | bound {bound / 1e6:.0f} | | |")
        for numel in sizes:
            param = torch.nn.Parameter(torch.randn(numel))
            param.grad = torch.randn(numel)
            rates = {}
            for name, optimizer in _optimizers(param, with_deepspeed).items():
                seconds = _best_seconds(optimizer.step, steps)
                rates[name] = numel / seconds
                print(f"| {num_threads} | {numel / (1 << 20):.0f}M | {name} | {seconds * 1e3:.2f} | "
                      f"{rates[name] / 1e6:.0f} | {rates[name] / rates['torch AdamW fused']:.2f} |"
                      f" {rates[name] / bound:.2f} |", flush=True)
                del optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M"], help="e.g. 1M 16M 128M")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's DeepSpeedCPUAdam")
    args = parser.parse_args()
    run([_parse_size(s) for s in args.sizes], args.threads, args.steps, args.deepspeed)


if __name__ == "__main__":
    main()
