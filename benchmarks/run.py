"""`make bench`: zerospeed against torch DDP, FSDP2 and (when installed) DeepSpeed, in one run.

    python benchmarks/run.py --model small --rounds 2
    python benchmarks/run.py --model wide4 --rounds 1 --steps 16 --warmup 3
    python benchmarks/run.py --model wide10 --rounds 1 --steps 5 --warmup 2
    python benchmarks/run.py --model tiny --systems ddp zerospeed-z0 --rounds 1 --steps 6

Prints one row per system (medians over the rounds; each figure from the slowest / largest rank):
step time median and minimum, forward / backward / optimizer-step medians, CPU time, peak RSS per
rank over the run and within each phase, the live tensor state per rank after the optimizer step,
payload MiB communicated per step per rank, the final loss, and step-time and peak-RSS ratios
against the peers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections import defaultdict

import torch

from harness import MICRO_BATCH, MODELS, RunResult, RunSpec, median_results, run

DEFAULT_SYSTEMS = ["ddp", "fsdp2", "zerospeed-z0", "zerospeed-z1", "zerospeed-z2", "zerospeed-z3",
                   "deepspeed-z1", "deepspeed-z2", "deepspeed-z3"]  # deepspeed-z0 on request
# the peers a zerospeed stage is held against for peak RSS (issue 21: <= the lowest of them)
SAME_STAGE_PEERS = {0: ["ddp", "deepspeed-z0"], 1: ["deepspeed-z1"], 2: ["deepspeed-z2"],
                    3: ["fsdp2", "deepspeed-z3"]}


def parse_system(text: str, args: argparse.Namespace) -> RunSpec:
    name, _, stage = text.partition("-z")
    dtype = "fp32"
    if stage.endswith("-bf16"):
        stage, dtype = stage[:-5], "bf16"
    if name.endswith("-bf16"):
        name, dtype = name[:-5], "bf16"
    return RunSpec(system=name, stage=int(stage or 0), dtype=dtype, model=args.model, steps=args.steps,
                   warmup=args.warmup, micro_batch=args.micro_batch or MICRO_BATCH.get(args.model, 4), zero_overrides=json.loads(args.zero))


def available(spec: RunSpec) -> bool:
    if spec.system == "deepspeed":
        return importlib.util.find_spec("deepspeed") is not None
    if spec.system == "zerospeed" and spec.stage in (1, 2):
        return importlib.util.find_spec("zerospeed.runtime.zero.stage_1_and_2") is not None
    if spec.system == "zerospeed" and spec.stage == 3:
        return importlib.util.find_spec("zerospeed.runtime.zero.stage3") is not None
    return True


def _same_stage(row: RunResult, by_label: dict[str, RunResult]) -> tuple[RunResult | None, RunResult | None]:
    """(DeepSpeed at the row's stage and dtype, the same-stage peer with the lowest peak RSS)."""
    if not row.label.startswith("zerospeed-z"):
        return None, None
    stage = int(row.label[len("zerospeed-z")])
    suffix = row.label[len("zerospeed-z") + 1:]
    peers = [by_label[p + suffix] for p in SAME_STAGE_PEERS[stage] if p + suffix in by_label]
    lowest = min(peers, key=lambda r: r.peak_rss_mib) if peers else None
    return by_label.get(row.label.replace("zerospeed", "deepspeed", 1)), lowest


def _state(row: RunResult) -> str:
    if row.state_allocated_mib > 1.1 * row.state_mib:
        return f"{row.state_mib:.0f} ({row.state_allocated_mib:,.0f} allocated)"
    return f"{row.state_mib:.0f}"


def print_table(rows: list[RunResult], peers: list[str]) -> None:
    """One row per system: absolute figures, then ratios against each peer, against DeepSpeed at
    the same stage and dtype, and (peak RSS) against the lowest same-stage peer."""
    header = ("| system | step median s | step min s | median / min | fwd / bwd / opt s | CPU s | peak RSS MiB/rank "
              "| fwd / bwd / step peak MiB | model state MiB/rank | comm MiB/step | final loss |")
    header += "".join(f" step / {p} |" for p in peers)
    header += " step / DS same stage | RSS / DS same stage | RSS / lowest peer same stage |"
    print(header)
    print("|" + "---|" * (14 + len(peers)))
    by_label = {r.label: r for r in rows}
    for row in rows:
        line = (f"| {row.label} | {row.step_s:.3f} | {row.step_min_s:.3f} | {row.step_s / row.step_min_s:.2f} | "
                + " / ".join(f"{t:.3f}" for t in row.phases_s) + f" | {row.cpu_s:.3f} | {row.peak_rss_mib:.0f} | "
                + " / ".join(f"{m:.0f}" for m in row.phase_peak_mib)
                + f" | {_state(row)} | {row.comm_mib_per_step:.1f} | {row.final_loss:.4f} |")
        line += "".join(f" {row.step_s / by_label[p].step_s:.2f} |" for p in peers)
        deepspeed, lowest = _same_stage(row, by_label)
        line += (f" {row.step_s / deepspeed.step_s:.2f} | {row.peak_rss_mib / deepspeed.peak_rss_mib:.2f} |"
                 if deepspeed else " | |")
        line += f" {row.peak_rss_mib / lowest.peak_rss_mib:.2f} ({lowest.label}) |" if lowest else " |"
        print(line)


def _num_params(model: str) -> int:
    from gpt import GPT, GPTConfig  # examples/, on the path through harness

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(GPTConfig(**MODELS[model])).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=None, help="default: the model's (wide4: 8, else 4)")
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
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nmodel={args.model} ({MODELS[args.model]}, {_num_params(args.model) / 1e6:.2f}M params, micro-batch "
          f"{specs[0].micro_batch}), 2 ranks x 1 thread, gloo, {args.steps} steps ({args.warmup} warm-up dropped), "
          f"medians over {args.rounds} rounds; load average now {load}")
    print_table(rows, peers)


if __name__ == "__main__":
    main()
