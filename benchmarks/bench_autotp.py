"""AutoTP step time, zerospeed vs DeepSpeed 0.19.8, on CPU ranks (gloo), alternating rounds.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_autotp.py --rounds 2 --steps 8

A Llama-style HF model (`--hidden`, `--layers`) with `tensor_parallel.autotp_size` = 2 on 2 ranks
(dp 1), ZeRO stage 1, fp32, SGD with clipping; each run in fresh processes. Reports the median step
time of the slowest rank (first 3 steps dropped) and the final loss, per library and round, and
the ratio zerospeed / DeepSpeed of the medians over rounds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

WARMUP = 3


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=512, tie_word_embeddings=False))


def _worker(rank: int, impl: str, init_file: str, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2",
                      DS_ACCELERATOR="cpu", ZS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ds = importlib.import_module(impl)
    config = {"train_micro_batch_size_per_gpu": args.micro, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    model = ds.tp_model_init(_model(args.hidden, args.layers), tp_size=2, dtype=torch.float32)
    engine, _, _, _ = ds.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(1)
    times, loss = [], None
    for _ in range(args.steps):
        ids = torch.randint(0, 1024, (args.micro, args.seq), generator=generator)
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    out[rank] = (statistics.median(times[WARMUP:]), loss.item() if loss is not None else float("nan"))


def run(impl: str, args: argparse.Namespace) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(impl, os.path.join(tmp, "rdzv"), args, out), nprocs=2, join=True)
        return max(out[r][0] for r in range(2)), out[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"zerospeed": [], "deepspeed": []}
    for round_index in range(args.rounds):
        for impl in (("zerospeed", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "zerospeed")):
            step_s, loss = run(impl, args)
            medians[impl].append(step_s)
            print(f"round {round_index} {impl:9s} step {step_s:.4f} s  final loss {loss:.4f}", flush=True)
    ours, theirs = statistics.median(medians["zerospeed"]), statistics.median(medians["deepspeed"])
    print(f"median step: zerospeed {ours:.4f} s, DeepSpeed {theirs:.4f} s, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
