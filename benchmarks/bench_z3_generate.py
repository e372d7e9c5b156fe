"""ZeRO-3 greedy generation at 2 ranks (gloo, 1 thread each): zerospeed gathered once against
DeepSpeed 0.19.8 generating the same tokens; and the peak of the full-weight stream.

    PYTHONPATH=$PWD DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_z3_generate.py --rounds 2

Each library runs in fresh processes (benchmarks/harness.py `spawn_ranks`): a Llama-style HF model
(`--hidden`, `--layers`) built under `zero.Init`, wrapped by `initialize` at stage 3 with an
optimizer (the RL policy), then greedy `generate` of `--new-tokens` tokens for `--batch` prompts
two ways: *hooked* (`module.generate` with the ZeRO-3 hooks on: every layer gathered for every
token, what DeepSpeed users get without TRL's context) and *once* (TRL's `unwrap_model_for_generation`:
hooks removed, `GatheredParameters(model.parameters())`, hooks restored; the gather is timed in).
Reported: tokens/s of each (slowest rank), the ratio zerospeed-once / DeepSpeed-hooked (the goal of
issue 29 is >= 3), whether every run produced the same tokens, and, for zerospeed,
`engine.iter_full_weights(bucket_bytes=model/8)`: the most parameter bytes held gathered at once
during the stream against the model size.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_rank, spawn_ranks  # noqa: E402


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.5)
    return LlamaForCausalLM(config)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)


def _timed(fn: Any) -> tuple[float, Any]:
    torch.distributed.barrier()
    start = time.perf_counter()
    out = fn()
    elapsed = torch.tensor(time.perf_counter() - start)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)   # the slowest rank
    return float(elapsed), out


def _once(ds: Any, engine: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from trl.models.utils import add_hooks, remove_hooks

    with ds.zero.GatheredParameters(engine.parameters()):
        remove_hooks(engine)
        tokens = _greedy(engine.module, ids, new_tokens)
        add_hooks(engine)
    return tokens


def _stream_peak(engine: Any, bucket_bytes: int) -> int:
    """The most non-persistent parameter bytes this rank held whole at once during the stream."""
    peak = 0
    for _, tensor in engine.iter_full_weights(bucket_bytes=bucket_bytes):
        held = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.numel() and not p.ds_persist)
        peak = max(peak, held)
        del tensor
    return peak


def _worker(rank: int, impl: str, args: argparse.Namespace, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2",
                      DS_ACCELERATOR="cpu", ZS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ds = importlib.import_module(impl)
    # imported before zero.Init: DeepSpeed's Init patches torch.Tensor.__new__, which breaks
    # torch._dynamo's import when transformers loads it lazily inside the context
    import transformers.generation.utils  # noqa: F401
    import trl.models.utils  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    config = {"train_micro_batch_size_per_gpu": args.batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    with ds.zero.Init(config_dict_or_path=config):
        model = _model(args)
    engine, *_ = ds.initialize(model=model, config=config)
    engine.eval()
    ids = torch.randint(0, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"impl": impl}
    with torch.no_grad():
        _once(ds, engine, ids, 2)   # warm-up
        for way, fn in (("once", lambda: _once(ds, engine, ids, args.new_tokens)),
                        ("hooked", lambda: _greedy(engine.module, ids, args.new_tokens))):
            seconds, tokens = _timed(fn)
            out[way] = {"tokens_per_s": args.batch * args.new_tokens / seconds, "tokens": tokens.tolist()}
    if impl == "zerospeed":
        model_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
        out["model_bytes"], out["bucket_bytes"] = model_bytes, model_bytes // 8
        out["stream_peak_bytes"] = _stream_peak(engine, model_bytes // 8)
    finish_rank(results, out if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {}
    tokens: list[Any] = []
    for round_index in range(args.rounds):
        for impl in ("zerospeed", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "zerospeed"):
            out = spawn_ranks(_worker, 2, impl, args, label=impl)[0]
            for way in ("once", "hooked"):
                rates.setdefault(f"{impl} {way}", []).append(out[way]["tokens_per_s"])
                tokens.append(out[way]["tokens"])
                print(f"round {round_index} {impl:9s} {way:6s}: {out[way]['tokens_per_s']:8.1f} tokens/s", flush=True)
            if "stream_peak_bytes" in out:
                print(f"round {round_index} weight stream: model {out['model_bytes'] / 2**20:.1f} MiB, bucket "
                      f"{out['bucket_bytes'] / 2**20:.1f} MiB, peak gathered {out['stream_peak_bytes'] / 2**20:.2f} MiB "
                      f"({out['stream_peak_bytes'] / out['model_bytes']:.2f} of the model)", flush=True)
    medians = {key: statistics.median(values) for key, values in rates.items()}
    for key, value in medians.items():
        print(f"median {key:16s}: {value:8.1f} tokens/s")
    print(f"zerospeed once / DeepSpeed hooked: {medians['zerospeed once'] / medians['deepspeed hooked']:.1f}x; "
          f"zerospeed once / DeepSpeed once: {medians['zerospeed once'] / medians['deepspeed once']:.2f}x")
    print(f"same tokens in every run: {all(t == tokens[0] for t in tokens)}")


if __name__ == "__main__":
    main()
