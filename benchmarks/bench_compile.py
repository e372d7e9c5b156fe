"""`engine.compile()` against the eager engine and against DeepSpeed 0.19.8's compiled engine:
step time of the benchmark GPT (examples/gpt.py) at ZeRO 0-3, 2 ranks x 1 thread, gloo, inductor.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compile.py                 # stages 0-3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compile.py --stages 3 --layers 2 --steps 6

One user script for both libraries: the GPT (`--layers`, `--embd`, 4 heads, vocab 256, sequence
`--seq`), fp32, AdamW (torch's), micro-batch `--batch`; `engine.compile(backend="inductor")` for
the compiled runs (zerospeed at stage 3 compiles each block with the ZeRO hooks outside; DeepSpeed
compiles the whole module, hooks included). Every run is a fresh pair of processes; the first
`--warmup` steps (inductor builds its C++ kernels there) are dropped, and the row is the slowest
rank's median step. The four runs of a stage run back to back in each round, the libraries'
order alternating between rounds, so the ratios compare runs taken under the same load.

`--ceiling` adds plain PyTorch (`torch`: the same model, AdamW and batch in the same two
processes, no ZeRO engine, `model.compile()` for the compiled run) once per round: what inductor
itself buys on this model and machine, the bound any engine's compiled/eager ratio is read against.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_rank, spawn_ranks  # noqa: E402

WORLD = 2
GPT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt.py")


@dataclasses.dataclass
class Spec:
    impl: str        # zerospeed | deepspeed | torch (plain PyTorch, no engine)
    compiled: bool
    stage: int
    layers: int
    embd: int
    seq: int
    batch: int
    steps: int
    warmup: int

    @property
    def label(self) -> str:
        return f"{self.impl}-z{self.stage}-{'compiled' if self.compiled else 'eager'}"


def _gpt(spec: Spec) -> torch.nn.Module:
    module_spec = importlib.util.spec_from_file_location("bench_gpt", GPT_PATH)
    assert module_spec is not None and module_spec.loader is not None
    gpt = importlib.util.module_from_spec(module_spec)
    sys.modules["bench_gpt"] = gpt
    module_spec.loader.exec_module(gpt)
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(block_size=spec.seq, n_layer=spec.layers, n_head=4, n_embd=spec.embd))


class _PlainTorch:
    """The engine's three calls over plain PyTorch: each rank trains its own copy, no gradient
    exchange (the ceiling measures what compiling the model buys, not communication)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


def _plain_torch(spec: Spec) -> Any:
    model = _gpt(spec)
    if spec.compiled:
        model.compile(backend="inductor")
    return _PlainTorch(model)


def _engine(spec: Spec) -> Any:
    ds = importlib.import_module(spec.impl)
    ds.init_distributed(dist_backend="gloo")
    model = _gpt(spec)
    config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": spec.stage}}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    if spec.compiled:
        engine.compile(backend="inductor")
    return engine


def _worker(rank: int, spec: Spec, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu", ZS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # Inductor's pool of compile workers would otherwise stay on the two cores beside the ranks.
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    engine = _plain_torch(spec) if spec.impl == "torch" else _engine(spec)
    generator = torch.Generator().manual_seed(100 + rank)
    step_s, loss = [], torch.zeros(())
    for _ in range(spec.steps):
        tokens = torch.randint(0, 256, (spec.batch, spec.seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        start = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - start)
    stats = torch.tensor([statistics.median(step_s[spec.warmup:]), sum(step_s[:spec.warmup]), loss.item()],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, stats)
    slowest = torch.stack(gathered).max(dim=0).values.tolist()
    finish_rank(results, (slowest[0], slowest[1], stats[2].item()) if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="dropped steps (compilation happens there)")
    parser.add_argument("--ceiling", action="store_true", help="add plain PyTorch eager and compiled each round")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for round_index in range(args.rounds):
        impls = ("zerospeed", "deepspeed") if round_index % 2 == 0 else ("deepspeed", "zerospeed")
        runs = [(impl, stage) for stage in args.stages for impl in impls]
        if args.ceiling:
            runs.insert(0 if round_index % 2 else len(runs), ("torch", 0))
        for impl, stage in runs:
            for compiled in (False, True):
                spec = Spec(impl, compiled, stage, args.layers, args.embd, args.seq, args.batch,
                            args.steps, args.warmup)
                result = spawn_ranks(_worker, WORLD, spec, label=spec.label)[0]
                rows.setdefault(spec.label, []).append(result)
                print(f"round {round_index} {spec.label:28s} step {result[0]:.4f} s  warm-up {result[1]:.1f} s  "
                      f"loss {result[2]:.6f}", flush=True)
    _table(rows, args.stages)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _table(rows: dict[str, list[tuple[float, float, float]]], stages: list[int]) -> None:
    def step(impl: str, stage: int, mode: str) -> float:
        return statistics.median(r[0] for r in rows[f"{impl}-z{stage}-{mode}"])

    print("\n| stage | zerospeed eager s | zerospeed compiled s | DeepSpeed eager s | DeepSpeed compiled s "
          "| zs compiled / zs eager | zs compiled / DS compiled |")
    print("|---|---|---|---|---|---|---|")
    for stage in stages:
        zs_e, zs_c = step("zerospeed", stage, "eager"), step("zerospeed", stage, "compiled")
        ds_e, ds_c = step("deepspeed", stage, "eager"), step("deepspeed", stage, "compiled")
        print(f"| {stage} | {zs_e:.4f} | {zs_c:.4f} | {ds_e:.4f} | {ds_c:.4f} | {zs_c / zs_e:.2f} | {zs_c / ds_c:.2f} |")
    if "torch-z0-eager" in rows:
        eager, compiled = step("torch", 0, "eager"), step("torch", 0, "compiled")
        print(f"\nplain PyTorch (no engine): eager {eager:.4f} s, compiled {compiled:.4f} s, "
              f"compiled / eager {compiled / eager:.2f} (the ceiling)")


if __name__ == "__main__":
    main()
