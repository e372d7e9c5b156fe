"""Muon's optimizer-step cost under ZeRO, as ratios: against AdamW, and against DeepSpeed 0.19.8's Muon.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_muon.py                 # stages 1 2 3, both libraries
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_muon.py --stages 2 --impls zerospeed --layers 4
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_muon.py --offload   # + offload_optimizer: cpu rows

2 CPU ranks x 1 thread (gloo). The model: an embedding, `--layers` blocks of two `--hidden` x
4*`--hidden` matrices and a square one (all Muon's), biases and norms (AdamW's), a head. Each run
is fresh processes; rounds alternate the runs so machine noise hits all alike. Measured: the
slowest rank's median training step (forward + backward + `engine.step()`) and median
`engine.step()` alone, first `--warmup` steps dropped. The whole step is the fair figure:
DeepSpeed's ZeRO 1/2 runs Newton-Schulz inside the gradient reduction (in backward), zerospeed in
`step()`. Reported: Muon / AdamW per library and stage, and zerospeed Muon / DeepSpeed Muon.

DeepSpeed needs `reduce_scatter: false` at stage 3 for Muon (it refuses the default); the AdamW
runs use the same ZeRO settings. DeepSpeed runs Newton-Schulz in fp16 / bf16 on a CPU with them
and wraps `muon_update` in torch.compile; `--ds-eager` turns dynamo off for it (compiling on a
loaded machine takes minutes). zerospeed runs Newton-Schulz in fp32.

`--offload` adds the same runs with `offload_optimizer: {"device": "cpu"}` (rows marked `+off`):
AdamW is then the library's CPU Adam (no `torch_adam`), Muon keeps its state in host memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_rank, spawn_ranks  # noqa: E402

VOCAB, MICRO, SEQ = 512, 4, 32


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.attn = torch.nn.Linear(hidden, hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class Model(torch.nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.layers = torch.nn.ModuleList([Block(hidden) for _ in range(layers)])
        self.lm_head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _config(optimizer: str, stage: int, offload: bool) -> dict[str, Any]:
    # Offloaded AdamW is the CPU Adam op in both libraries (what offload users run).
    adamw = {"lr": 1e-3, "weight_decay": 0.01} if offload else {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}
    block = ({"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01}} if optimizer == "muon"
             else {"type": "AdamW", "params": adamw})
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": block, "zero_optimization": zero}


def _rank(rank: int, impl: str, optimizer: str, stage: int, offload: bool, args: Any, init_file: str,
          results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      DS_ACCELERATOR="cpu", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if impl == "deepspeed" and args.ds_eager:
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True
    library = __import__(impl)
    torch.manual_seed(0)
    model = Model(args.hidden, args.layers)
    engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                         config=_config(optimizer, stage, offload))
    generator = torch.Generator().manual_seed(rank)
    whole, step_only = [], []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.backward(engine(tokens))
        middle = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        whole.append(end - start)
        step_only.append(end - middle)
    medians = torch.tensor([statistics.median(whole[args.warmup:]), statistics.median(step_only[args.warmup:])])
    torch.distributed.all_reduce(medians, op=torch.distributed.ReduceOp.MAX)
    finish_rank(results, tuple(medians.tolist()) if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--impls", nargs="+", default=["zerospeed", "deepspeed"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ds-eager", action="store_true", help="DeepSpeed without torch.compile")
    parser.add_argument("--offload", action="store_true", help="also offload_optimizer: cpu")
    args = parser.parse_args()
    offloads = (False, True) if args.offload else (False,)
    runs = [(impl, opt, stage, off) for stage in args.stages for off in offloads for impl in args.impls
            for opt in ("muon", "adamw")]
    times: dict[tuple[str, str, int, bool], list[tuple[float, float]]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for run in runs:
            label = "-".join(map(str, run[:3])) + ("-offload" if run[3] else "")
            times[run] += spawn_ranks(_rank, 2, *run, args, label=label)
            whole, step = times[run][-1]
            print(f"{label}: step {whole * 1e3:.1f} ms, optimizer {step * 1e3:.1f} ms", file=sys.stderr, flush=True)
    best = {run: (min(w for w, _ in values), min(s for _, s in values)) for run, values in times.items()}
    print(f"best of {args.rounds} rounds of the slowest rank's median; hidden {args.hidden}, {args.layers} layers, "
          "2 ranks x 1 thread; whole step (fwd+bwd+step) and optimizer step")
    for stage in args.stages:
        for off in offloads:
            _report(best, stage, off, args.impls)


def _report(best: dict, stage: int, off: bool, impls: list[str]) -> None:
    tag = f"z{stage}{'+off' if off else ''}"
    for impl in impls:
        (muon, muon_opt), (adamw, adamw_opt) = best[(impl, "muon", stage, off)], best[(impl, "adamw", stage, off)]
        print(f"  {tag:6s} {impl:9s}: Muon {muon * 1e3:7.1f} ms (opt {muon_opt * 1e3:6.1f})  AdamW "
              f"{adamw * 1e3:7.1f} ms (opt {adamw_opt * 1e3:6.1f})  Muon/AdamW whole step {muon / adamw:5.2f}")
    if {"zerospeed", "deepspeed"} <= set(impls):
        ratio = best[("zerospeed", "muon", stage, off)][0] / best[("deepspeed", "muon", stage, off)][0]
        print(f"  {tag:6s} zerospeed Muon / DeepSpeed Muon, whole step: {ratio:5.2f}")


if __name__ == "__main__":
    main()
