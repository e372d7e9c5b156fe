"""Ulysses sequence-parallel step time, zerospeed vs DeepSpeed 0.19.8, on CPU ranks (gloo), alternating rounds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sp_step.py            # stages 1 2, seq 4096
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sp_step.py --stages 3 --profile /tmp/sp-prof

One user script for both libraries: a Llama-style HF model (hidden 256, `--layers`, 8 query / 4 KV
heads, vocab 512, sdpa) through `UlyssesSPAttentionHF.register_with_transformers` (sp 2 on 2 ranks x
1 thread, so dp 1), each rank's batches through `UlyssesSPDataLoaderAdapter`, `initialize(mpu=...)`
with the ZeRO stage, fp32, AdamW (torch's). The loss is the ALST recipe transformers' Trainer uses
under sp (tests/compat/scripts/tiny_llama.py): each rank's mean loss over its shard, all-gathered
with autograd and averaged with the shards' token counts as weights -- the same code on both.

Gradients then differ by a constant: DeepSpeed divides by the data-parallel size only, so its
gradients are sp times zerospeed's (which equal full-sequence training; docs/compatibility.md).
Adam is invariant to that scale up to its eps, so both runs follow the same trajectory and their
final losses agree to fp32 rounding (SGD would not; the compat test pins the factor instead).

Per run (fresh processes): the slowest rank's median step (forward + loss + backward + optimizer
step, first `--warmup` steps dropped), the median process CPU seconds of a step, the data loader's
mean milliseconds per micro-batch (the adapter's gather and shard, outside the step), the largest
rank's peak RSS, and the final loss. `--profile DIR` writes cProfile stats of rank 0's measured
steps (process-time clock) to DIR/<library>-z<stage>.prof.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_rank, spawn_ranks  # noqa: E402

HEADS, KV_HEADS, VOCAB, SP = 8, 4, 512, 2
DS_EXTENSIONS = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", "deepspeed-0.19.8")


@dataclasses.dataclass
class Spec:
    impl: str  # zerospeed | deepspeed
    stage: int
    seq: int
    layers: int
    hidden: int
    steps: int
    warmup: int
    profile: str | None

    @property
    def label(self) -> str:
        return f"{self.impl}-z{self.stage}"


@dataclasses.dataclass
class Result:
    step_s: float
    cpu_s: float
    loader_ms: float
    peak_rss_mib: float
    final_loss: float


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1 << 16,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def _batches(rank: int, spec: Spec) -> list[dict[str, torch.Tensor]]:
    """This rank's own full-length samples; the adapter hands out one shard of each group sample per step."""
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(spec.steps // SP):
        ids = torch.randint(0, VOCAB, (1, spec.seq), generator=generator)
        batches.append({"input_ids": ids, "position_ids": torch.arange(spec.seq)[None], "labels": ids.clone()})
    return batches


def recipe_loss(engine: Any, batch: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    """The shards' mean losses weighted by their unmasked tokens (ALST / transformers' Trainer under sp)."""
    import torch.distributed.nn.functional as dist_fn

    labels = batch["shift_labels"]
    loss = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=labels,
                  shift_labels=labels).loss
    losses = torch.stack(dist_fn.all_gather(loss, group=group))
    tokens = torch.stack(dist_fn.all_gather((labels != -100).view(-1).sum(), group=group))
    return (losses * tokens).sum() / tokens.sum().clamp(min=1)


def _engine(ds: Any, spec: Spec) -> tuple[Any, Any, Any]:
    alst = importlib.import_module(f"{spec.impl}.runtime.sequence_parallel.ulysses_sp")
    model = _model(spec.hidden, spec.layers)
    mpu = alst.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=SP,
                                                               micro_batch_size=1)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": spec.stage}}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    return engine, mpu, alst


def _worker(rank: int, spec: Spec, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(SP), LOCAL_RANK=str(rank), LOCAL_SIZE=str(SP),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu", ZS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", DS_EXTENSIONS)  # the compat suite's prebuilt CPU ops
    warnings.filterwarnings("ignore")  # transformers' and torch's deprecation notes, once per rank and run
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SP)
    ds = importlib.import_module(spec.impl)
    ds.init_distributed(dist_backend="gloo")  # adopts the group above (deepspeed.comm needs it for the mpu)
    engine, mpu, alst = _engine(ds, spec)
    group = mpu.get_sequence_parallel_group()
    loader = alst.UlyssesSPDataLoaderAdapter(_batches(rank, spec), sp_rank=mpu.get_sequence_parallel_rank(),
                                             sp_group=group, sp_world_size=SP, device="cpu")
    profiler = _profiler(rank, spec)
    step_s, cpu_s, loader_s, loss = [], [], 0.0, torch.zeros(())
    for index in range(spec.steps):
        start = time.perf_counter()
        batch = next(loader)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        loader_s += wall0 - start
        if profiler is not None and index == spec.warmup:
            profiler.enable()
        loss = recipe_loss(engine, batch, group)
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - wall0)
        cpu_s.append(time.process_time() - cpu0)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(spec.profile or ".", f"{spec.label}.prof"))
    stats = torch.tensor([statistics.median(step_s[spec.warmup:]), statistics.median(cpu_s[spec.warmup:]),
                          1e3 * loader_s / spec.steps, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          loss.item()], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(SP)]
    torch.distributed.all_gather(gathered, stats)
    largest = torch.stack(gathered).max(dim=0).values.tolist()
    finish_rank(results, Result(*largest[:4], final_loss=stats[4].item()) if rank == 0 else None)


def _profiler(rank: int, spec: Spec) -> Any:
    if spec.profile is None or rank != 0:
        return None
    import cProfile

    os.makedirs(spec.profile, exist_ok=True)
    return cProfile.Profile(time.process_time)


def run(spec: Spec) -> Result:
    return spawn_ranks(_worker, SP, spec, label=spec.label)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="micro-steps per run (even: sp shards per sample)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096, help="global sequence length (each rank holds seq / 2)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--profile", default=None, help="directory for rank 0's cProfile stats")
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows: dict[str, list[Result]] = {}
    for round_index in range(args.rounds):
        order = ("zerospeed", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "zerospeed")
        for stage in args.stages:
            for impl in order:
                spec = Spec(impl, stage, args.seq, args.layers, args.hidden, args.steps, args.warmup, args.profile)
                result = run(spec)
                rows.setdefault(spec.label, []).append(result)
                print(f"round {round_index} {spec.label:13s} step {result.step_s:.3f} s  cpu {result.cpu_s:.3f} s  "
                      f"loss {result.final_loss:.6f}", flush=True)
    _table(rows, args.stages)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.perf_counter() - began:.0f} s in all")


def _table(rows: dict[str, list[Result]], stages: list[int]) -> None:
    def median(label: str, name: str) -> float:
        return statistics.median(getattr(r, name) for r in rows[label])

    print("\n| stage | library | step s (median) | CPU s / step | loader ms / batch | peak RSS MiB | final loss |")
    print("|---|---|---|---|---|---|---|")
    for stage in stages:
        for impl in ("zerospeed", "deepspeed"):
            label = f"{impl}-z{stage}"
            print(f"| {stage} | {impl} | {median(label, 'step_s'):.3f} | {median(label, 'cpu_s'):.3f} | "
                  f"{median(label, 'loader_ms'):.1f} | {median(label, 'peak_rss_mib'):.0f} | "
                  f"{rows[label][-1].final_loss:.6f} |")
    print()
    for stage in stages:
        ours, theirs = f"zerospeed-z{stage}", f"deepspeed-z{stage}"
        print(f"stage {stage}: step ratio zerospeed / DeepSpeed {median(ours, 'step_s') / median(theirs, 'step_s'):.2f}"
              f" (CPU {median(ours, 'cpu_s') / median(theirs, 'cpu_s'):.2f}); final losses differ by "
              f"{abs(rows[ours][-1].final_loss - rows[theirs][-1].final_loss):.2e}")


if __name__ == "__main__":
    main()
