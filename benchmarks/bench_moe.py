"""MoE training step time and peak RSS, zerospeed against DeepSpeed 0.19.8 at the same config.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_moe.py --world-sizes 2 4 --rounds 1

Each (library, world size) runs in fresh processes through the compat harness
(tests/compat/compat_harness.py: one script, `benchmarks/moe_step_script.py`, run on either
library, gloo ranks, one thread each); rounds alternate which library goes first. The model:
`--layers` MoE layers with `--num-experts` experts (4x MLPs), ep_size = world size, k = 2,
capacity factor 1.25, AdamW (torch), clipping 1.0, fp32, ZeRO `--stage`. Reported per run: median
step wall time and process CPU time of the slowest rank (warm-up dropped; CPU time suffers less
from a loaded machine), peak RSS of the largest rank; then the ratios ours / DeepSpeed of the
medians over rounds. `--phases` adds, per run, the resident memory of each phase of a step on
the rank with the largest peak (moe_step_script.py: RSS at the phase's start, its peak, at its end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "compat"), os.path.join(HERE, "..", "tests")]
SCRIPT = os.path.join(HERE, "moe_step_script.py")


def _run(impl: str, world_size: int, args: argparse.Namespace) -> dict:
    from compat_harness import run_script

    with tempfile.TemporaryDirectory(prefix="zs-bench-moe-") as work:
        ranks = run_script(SCRIPT, impl, work, world_size, stage=args.stage, steps=args.steps, warmup=args.warmup,
                           tokens=args.tokens, d_model=args.d_model, num_experts=args.num_experts, layers=args.layers,
                           phases=args.phases)
    largest = max(ranks, key=lambda r: r["peak_rss_mib"])
    return {"step_s": max(r["step_s"] for r in ranks), "cpu_s": max(r["cpu_s"] for r in ranks),
            "peak_rss_mib": largest["peak_rss_mib"], "final_loss": ranks[0]["losses"][-1],
            "baseline_rss_mib": largest["baseline_rss_mib"], "phases": largest["phases"],
            "first_phases": largest["first_phases"]}


def _print_phases(world_size: int, impl: str, result: dict) -> None:
    for steps, table in (("first", result["first_phases"]), ("later", result["phases"])):
        init = table.pop("initialize", None)
        cells = " | ".join(f"{p['start']:.0f} / {p['peak']:.0f} / {p['end']:.0f}" for p in table.values())
        init_cell = "" if init is None else f"{init['start']:.0f} / {init['peak']:.0f} / {init['end']:.0f}"
        print(f"| {world_size} | {impl} | {steps} | {result['baseline_rss_mib']:.0f} | {init_cell} | {cells} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--phases", action="store_true", help="RSS per phase of a step (start / peak / end MiB)")
    args = parser.parse_args()
    print("| ranks | library | step s | CPU s | peak RSS MiB | final loss |\n|---|---|---|---|---|---|")
    ratios = {}
    phase_runs: dict[int, list[tuple[str, dict]]] = {}
    for world_size in args.world_sizes:
        runs: dict[str, list[dict]] = {"zerospeed": [], "deepspeed": []}
        for round_index in range(args.rounds):
            order = ["zerospeed", "deepspeed"] if round_index % 2 == 0 else ["deepspeed", "zerospeed"]
            for impl in order:
                result = _run(impl, world_size, args)
                runs[impl].append(result)
                phase_runs.setdefault(world_size, []).append((impl, result))
                print(f"| {world_size} | {impl} | {result['step_s']:.4f} | {result['cpu_s']:.4f} | "
                      f"{result['peak_rss_mib']:.0f} | "
                      f"{result['final_loss']:.4f} |", flush=True)
        med = {impl: {key: statistics.median(r[key] for r in rs) for key in ("step_s", "cpu_s", "peak_rss_mib")}
               for impl, rs in runs.items()}
        ratios[world_size] = tuple(med["zerospeed"][key] / med["deepspeed"][key]
                                   for key in ("step_s", "cpu_s", "peak_rss_mib"))
    if args.phases:
        print("\n| ranks | library | steps | RSS after import | initialize | forward | backward | step |\n"
              "|---|---|---|---|---|---|---|---|")
        for world_size, runs_by_impl in phase_runs.items():
            for impl, result in runs_by_impl:
                _print_phases(world_size, impl, result)
    print("\n| ranks | step ours / DeepSpeed | CPU ours / DeepSpeed | peak RSS ours / DeepSpeed |\n|---|---|---|---|")
    for world_size, (step, cpu, rss) in ratios.items():
        print(f"| {world_size} | {step:.2f} | {cpu:.2f} | {rss:.2f} |")


if __name__ == "__main__":
    main()
