"""Ulysses sequence parallelism on CPU ranks: peak RSS per rank against sequence length at sp 1
and sp 2, the longest sequence within a per-rank memory budget, and all-to-all bytes per
attention layer against the theory.

    OMP_NUM_THREADS=1 python benchmarks/bench_sequence_parallel.py --budget-mib 1024

Each (sp, length) runs in fresh processes (world size = sp, one thread each, gloo): a Llama-style
model (`--hidden`, `--layers`, 8 query / 4 KV heads, sdpa) takes one SGD training step at ZeRO 0 on
one sample of that length; with sp 2 through `register_with_transformers` and the token-weighted
`sequence_parallel_cross_entropy`. Peak RSS is the rank's `ru_maxrss` after the step (the largest
rank). Memory grows linearly in the length here (sdpa on CPU does not materialise the score
matrix), so the longest length within the budget is solved from a least-squares line through the
measured points. All-to-all bytes are the comms logger's payload (the input tensor) per attention
layer per step; theory: 4 bytes x (s / sp) x head_dim x (2 (2 H + 2 H_kv) + H): q, k, v and the
output forward, their gradients backward, and the output once more in backward, where it is
rebuilt instead of being kept in two layouts ([Note: attention output in one layout]).

Host allocator: by default every worker runs with glibc's mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``, ``--malloc-mmap-threshold-mib``), the CPU counterpart of the CUDA
allocator setting in DeepSpeed's ALST recipe: freed activations go back to the system instead
of staying in malloc's heap, so peak RSS follows the live tensors. ``0`` keeps glibc's dynamic
threshold (docs/benchmarks.md has both).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp

HEADS, KV_HEADS, VOCAB = 8, 4, 512


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1 << 20,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _sp_engine(rank: int, world: int, init_file: str, hidden: int, layers: int) -> tuple[Any, Any, Any]:
    """This rank's engine for `_model`, Ulysses over all ranks: (engine, model, sequence-parallel group)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import zerospeed
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = _model(hidden, layers)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1) if world > 1 else None
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine, model, mpu.get_sequence_parallel_group() if mpu else torch.distributed.group.WORLD


def _worker(rank: int, world: int, init_file: str, length: int, hidden: int, layers: int, out: dict) -> None:
    engine, _, group = _sp_engine(rank, world, init_file, hidden, layers)
    from zerospeed.comm import comms_logger
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    chunk = slice(rank * length // world, (rank + 1) * length // world)
    comms_logger.configure(enabled=True, prof_all=True)
    comms_logger.reset()
    logits = engine(input_ids=ids[:, chunk], position_ids=torch.arange(length)[None, chunk]).logits
    loss = sequence_parallel_cross_entropy(logits, labels[:, chunk], group)
    engine.backward(loss)
    engine.step()
    out[rank] = {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                 "a2a_bytes": comms_logger.bytes_by_op().get("all_to_all_single", 0)}
    torch.distributed.barrier()
    os._exit(0)


def measure(sp: int, length: int, hidden: int, layers: int) -> dict:
    """Peak RSS (largest rank) and all-to-all bytes of one step; spawned workers inherit the environment."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(sp, os.path.join(tmp, "rdzv"), length, hidden, layers, out),
                           nprocs=sp, start_method="spawn", join=True)
        return {"peak_mib": max(r["peak_mib"] for r in out.values()), "a2a_bytes": out[0]["a2a_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mib", type=float, default=1024)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2], help="sequence-parallel sizes to run")
    parser.add_argument("--malloc-mmap-threshold-mib", type=float, default=1.0,
                        help="glibc mmap threshold for the workers (MALLOC_MMAP_THRESHOLD_); 0: glibc's dynamic default")
    args = parser.parse_args()
    if args.malloc_mmap_threshold_mib > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(int(args.malloc_mmap_threshold_mib * (1 << 20)))
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    print(f"host allocator: MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc dynamic)')}")
    head_dim = args.hidden // HEADS
    print("| sp | length | peak RSS MiB (max rank) | all-to-all bytes / layer / step | theory |")
    print("|---|---|---|---|---|")
    fits = {}
    for sp in args.sps:
        points = []
        for length in args.lengths:
            result = measure(sp, length, args.hidden, args.layers)
            theory = 0 if sp == 1 else 4 * (length // sp) * head_dim * (2 * (2 * HEADS + 2 * KV_HEADS) + HEADS)
            per_layer = result["a2a_bytes"] // args.layers
            print(f"| {sp} | {length} | {result['peak_mib']:.0f} | {per_layer} | {theory} |", flush=True)
            points.append((length, result["peak_mib"]))
        xs, ys = torch.tensor([p[0] for p in points], dtype=torch.float64), torch.tensor([p[1] for p in points],
                                                                                         dtype=torch.float64)
        slope = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
        intercept = ys.mean() - slope * xs.mean()
        fits[sp] = ((args.budget_mib - intercept) / slope).item()
        print(f"sp {sp}: peak ≈ {intercept:.0f} MiB + {slope * 1024:.1f} MiB per 1k tokens; "
              f"longest within {args.budget_mib:.0f} MiB ≈ {fits[sp]:.0f} tokens", file=sys.stderr, flush=True)
    if 1 in fits and 2 in fits:
        print(f"\nlongest sequence within {args.budget_mib:.0f} MiB per rank: sp 1 {fits[1]:.0f}, "
              f"sp 2 {fits[2]:.0f} tokens: {fits[2] / fits[1]:.2f}x")


if __name__ == "__main__":
    main()
