"""`make bench`: zerospeed against torch DDP, FSDP2 and (when installed) DeepSpeed, in one run.

    python benchmarks/run.py --model small --rounds 2
    python benchmarks/run.py --model tiny --systems ddp zerospeed-z0 --rounds 1 --steps 6

Prints a table of median step time (wall and CPU), peak RSS per rank, payload MiB communicated per
step per rank and the final loss, each run's ratios against each peer, medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import importlib.util
from collections import defaultdict

from harness import MODELS, RunResult, RunSpec, median_results, run

DEFAULT_SYSTEMS = ["ddp", "fsdp2", "zerospeed-z0", "zerospeed-z1", "zerospeed-z2", "zerospeed-z3",
                   "deepspeed-z0", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3"]


def parse_system(text: str, args: argparse.Namespace) -> RunSpec:
    name, _, stage = text.partition("-z")
    dtype = "fp32"
    if stage.endswith("-bf16"):
        stage, dtype = stage[:-5], "bf16"
    if name.endswith("-bf16"):
        name, dtype = name[:-5], "bf16"
    return RunSpec(system=name, stage=int(stage or 0), dtype=dtype, model=args.model, steps=args.steps,
                   warmup=args.warmup, micro_batch=args.micro_batch, zero_overrides=json.loads(args.zero))


def available(spec: RunSpec) -> bool:
    if spec.system == "deepspeed":
        return importlib.util.find_spec("deepspeed") is not None
    if spec.system == "zerospeed" and spec.stage in (1, 2):
        return importlib.util.find_spec("zerospeed.runtime.zero.stage_1_and_2") is not None
    if spec.system == "zerospeed" and spec.stage == 3:
        return importlib.util.find_spec("zerospeed.runtime.zero.stage3") is not None
    return True


def _same_stage_deepspeed(row: RunResult, by_label: dict[str, RunResult]) -> RunResult | None:
    if not row.label.startswith("zerospeed"):
        return None
    return by_label.get(row.label.replace("zerospeed", "deepspeed", 1))


def print_table(rows: list[RunResult], peers: list[str]) -> None:
    """One row per system: absolute figures, then step-time and RSS ratios against each peer and
    against DeepSpeed at the same stage and dtype."""
    header = "| system | step s | CPU s | peak RSS MiB | comm MiB/step | final loss |"
    header += "".join(f" step / {p} | RSS / {p} |" for p in peers) + " step / DS same stage | RSS / DS same stage |"
    print(header)
    print("|" + "---|" * (8 + 2 * len(peers)))
    by_label = {r.label: r for r in rows}
    for row in rows:
        line = (f"| {row.label} | {row.step_s:.3f} | {row.cpu_s:.3f} | {row.peak_rss_mib:.0f} | "
                f"{row.comm_mib_per_step:.1f} | {row.final_loss:.4f} |")
        for peer in peers:
            ref = by_label[peer]
            line += f" {row.step_s / ref.step_s:.2f} | {row.peak_rss_mib / ref.peak_rss_mib:.2f} |"
        same = _same_stage_deepspeed(row, by_label)
        line += (f" {row.step_s / same.step_s:.2f} | {row.peak_rss_mib / same.peak_rss_mib:.2f} |" if same
                 else " | |")
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--zero", default="{}", help="extra zero_optimization keys (JSON) for zerospeed and DeepSpeed")
    args = parser.parse_args()
    specs = [parse_system(s, args) for s in args.systems]
    skipped = [s.label for s in specs if not available(s)]
    specs = [s for s in specs if available(s)]
    if skipped:
        print(f"skipped (not installed / not built yet): {', '.join(skipped)}")
    collected: dict[str, list[RunResult]] = defaultdict(list)
    for round_index in range(args.rounds):
        order = specs if round_index % 2 == 0 else list(reversed(specs))  # alternate against drift
        for spec in order:
            result = run(spec)
            collected[spec.label].append(result)
            print(f"round {round_index + 1}: {result}", flush=True)
    rows = [median_results(collected[s.label]) for s in specs]
    peers = [label for label in ("ddp", "fsdp2") if label in collected]
    print(f"\nmodel={args.model} ({MODELS[args.model]}), 2 ranks x 1 thread, gloo, medians over {args.rounds} rounds")
    print_table(rows, peers)


if __name__ == "__main__":
    main()
