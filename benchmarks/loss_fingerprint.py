"""Print the fp32 losses of the benchmark GPT at ZeRO stages 0-3 (2 gloo ranks, fixed seeds), then
the losses and global gradient norms of short pipeline (2 stages, tied weights), MoE (ep 2), Ulysses
(sp 2) and AutoTP (tp 2) runs, each with clipping off and on.

A refactor that must not change numerics runs this before and after and diffs the output; the
numbers print as float.hex so "bit for bit" is a plain text comparison. The dense lines come first
and are unchanged by the parallel cases: `--dense-only` prints just them.

    PYTHONPATH=$PWD python benchmarks/loss_fingerprint.py > before.txt
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fingerprint_parallel import PARALLEL_RUNS
from harness import finish_rank, spawn_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

STEPS = 4
MICRO_BATCH = 2
WORLD_SIZE = 2
CASES = [(stage, clip) for stage in (0, 1, 2, 3) for clip in (0.0, 0.05)]


def _config(stage: int, clip: float) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                       "torch_adam": True}},
            "gradient_clipping": clip, "zero_optimization": {"stage": stage}}


def _worker(rank: int, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    import zerospeed
    from gpt import GPT, ByteWindows, GPTConfig, stdlib_bytes

    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)
    dataset = ByteWindows(stdlib_bytes(200_000), config.block_size)
    lines = []
    for stage, clip in CASES:
        torch.manual_seed(0)
        engine, _, _, _ = zerospeed.initialize(model=GPT(config), config=_config(stage, clip))
        losses = []
        for micro_step in range(STEPS * 2):
            start = (micro_step * WORLD_SIZE + rank) * MICRO_BATCH
            rows = [dataset[i] for i in range(start, start + MICRO_BATCH)]
            loss = engine(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()).hex())
        norm = engine.get_global_grad_norm()
        lines.append(f"stage={stage} clip={clip} rank={rank} norm={float(norm).hex()} losses={' '.join(losses)}")
    finish_rank(results, (rank, lines))


def _print_run(worker: Any, label: str) -> None:
    out = dict(spawn_ranks(worker, WORLD_SIZE, label=label, num_results=WORLD_SIZE, timeout_s=600.0))
    for rank in sorted(out):
        print("\n".join(out[rank]), flush=True)


def main() -> None:
    _print_run(_worker, "fp32 losses")
    if "--dense-only" in sys.argv[1:]:
        return
    for label, worker in PARALLEL_RUNS:
        _print_run(worker, label)


if __name__ == "__main__":
    main()
