"""Pipeline benchmark (issue 18): 4 CPU ranks x 1 thread over gloo, a GPT split into 4 stages.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_pipeline.py --rounds 1

Systems, alternating within each round (machine noise hits them alike):
  zs-1f1b, zs-gpipe, zs-interleaved   zerospeed's PipelineEngine with each `pipeline.schedule`
  ds-1f1b                             DeepSpeed 0.19.8's PipelineEngine (its only classic schedule)
  pt-1f1b, pt-gpipe                   torch.distributed.pipelining Schedule1F1B / ScheduleGPipe
Same layers (embedding, 8 GPT blocks, LayerNorm, LM head; untied, as torch.distributed.pipelining
has no tied weights across stages), same partition (2 blocks a stage), M micro-batches per step,
AdamW, fp32. Measured:
  - step time: median over the measured steps of the slowest rank (each step starts after a barrier),
    and CPU time summed over the ranks (less sensitive than wall time to other load on the machine);
  - idle fraction per stage (zerospeed), within the schedule's span: 1 - (the stage's forward +
    backward seconds) / (from the first instruction on any stage to the end of the last forward or
    backward on any stage), from the executor's timeline, against the schedule's theory ((S-1)/(M+S-1)
    for 1F1B and GPipe; the lowered timing model for interleaved). The span is common to all stages
    (timestamps from one machine-wide clock), as in the theory: a stage's own window would end
    earlier on later stages (their last backward ends first) and understate their idle time. The
    theory assumes equal stages; each stage's busy seconds are printed to show how equal they are;
  - stage-0 activation memory (zerospeed): bytes saved for backward and still alive (saved-tensor
    hooks, storages counted once, parameters excluded), peak over a step, in units of one
    micro-batch's saved bytes: the micro-batches in flight (1F1B's bound: S; GPipe holds M).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))
from harness import finish_rank, spawn_ranks  # noqa: E402

# The stage count travels to the spawned ranks through the environment (`--stages`): a machine
# with fewer cores than ranks measures core contention, not the schedule's idle fraction.
STAGES = int(os.environ.get("ZS_BENCH_PIPE_STAGES", "4"))
MICRO, M, STEPS, WARMUP = 2, 8, 6, 2
MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=128)
SYSTEMS = ["zs-1f1b", "ds-1f1b", "pt-1f1b", "zs-gpipe", "pt-gpipe", "zs-interleaved"]


class Embedding(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _specs(layer_spec: Any, config: Any) -> list[Any]:
    from gpt import Block

    return ([layer_spec(Embedding, config)] + [layer_spec(Block, config) for _ in range(config.n_layer)]
            + [layer_spec(nn.LayerNorm, config.n_embd), layer_spec(nn.Linear, config.n_embd, config.vocab_size,
                                                                  bias=False)])


def _batches(config: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = (MICRO * M, config.block_size)
    return [(torch.randint(0, config.vocab_size, shape, generator=generator),
             torch.randint(0, config.vocab_size, shape, generator=generator)) for _ in range(STEPS)]


def _micro(batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    return iter([(batch[0][k * MICRO:(k + 1) * MICRO], batch[1][k * MICRO:(k + 1) * MICRO]) for k in range(M)])


class SavedActivations:
    """Bytes saved for backward and alive now / at peak; each storage counted once, parameters not."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = self.total = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return tensor
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        holder = _Held(tensor)
        weakref.finalize(holder, self._release, key, storage.nbytes())
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    @staticmethod
    def unpack(value: Any) -> torch.Tensor:
        return value.tensor if isinstance(value, _Held) else value


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# --- one system's step function per rank ---------------------------------------------------------

def _optimizer_config() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}


def _zerospeed(schedule: str, config: Any, rank: int) -> tuple[Any, Any]:
    import zerospeed
    from zerospeed.pipe import LayerSpec, PipelineModule

    chunks = 2 if schedule == "interleaved" else 1
    module = PipelineModule(_specs(LayerSpec, config), num_stages=STAGES, loss_fn=lm_loss,
                            partition_method="type:Block", num_chunks=chunks)
    ds_config = {"train_batch_size": MICRO * M, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
                 "optimizer": _optimizer_config(),
                 "pipeline": {"schedule": {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved_1f1b"}[schedule]}}
    engine, _, _, _ = zerospeed.initialize(model=module, config=ds_config)
    return engine, lambda batch: engine.train_batch(_micro(batch))


def _deepspeed(config: Any, rank: int) -> tuple[Any, Any]:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's PipelineModule needs its comm backend
    module = PipelineModule(_specs(LayerSpec, config), num_stages=STAGES, loss_fn=lm_loss, partition_method="type:Block")
    ds_config = {"train_batch_size": MICRO * M, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
                 "optimizer": _optimizer_config()}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=ds_config)
    return engine, lambda batch: engine.train_batch(_micro(batch))


def _torch(schedule: str, config: Any, rank: int) -> tuple[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from zerospeed.pipe import LayerSpec
    from zerospeed.runtime.pipe.partition import partition_weights

    specs = _specs(LayerSpec, config)
    parts = partition_weights("type:Block", specs, STAGES)
    submodule = nn.Sequential(*[spec.build() for spec in specs[parts[rank]:parts[rank + 1]]])
    stage = PipelineStage(submodule, rank, STAGES, torch.device("cpu"))
    runner = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, n_microbatches=M, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(submodule.parameters(), lr=1e-3, weight_decay=0.01)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if rank == 0:
            runner.step(batch[0])
        elif rank == STAGES - 1:
            runner.step(target=batch[1], losses=[])
        else:
            runner.step()
        optimizer.step()
        optimizer.zero_grad()

    return submodule, step


# --- the worker ----------------------------------------------------------------------------------

_COMPUTE = ("ForwardPass", "BackwardPass")


def _timing(timeline: list[tuple[str, float, float]]) -> list[float]:
    """[first instruction's start, last compute's end, compute seconds] of one stage's batch."""
    compute = [(start, end) for name, start, end in timeline if name in _COMPUTE]
    return [timeline[0][1], max(end for _, end in compute), sum(end - start for start, end in compute)]


def _idle_in_span(timings: torch.Tensor) -> list[float]:
    """Per stage, 1 - compute / span summed over the steps; `timings` is [stage, step, _timing()].
    The span of a step runs from the first instruction on any stage to the last compute on any."""
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return [float("nan")] * timings.shape[0]   # timestamps of different processes not comparable
    span = (timings[:, :, 1].max(dim=0).values - timings[:, :, 0].min(dim=0).values).sum()
    return [1.0 - float(timings[stage, :, 2].sum() / span) for stage in range(timings.shape[0])]


def _theory(system: str, engine: Any) -> float:
    if system == "zs-interleaved":
        from zerospeed.runtime.pipe.schedule_lowering import Interleaved1F1BSchedule

        return Interleaved1F1BSchedule(M, STAGES, engine.stage_id, 2).bubble_fraction()
    return (STAGES - 1) / (M + STAGES - 1)


def _worker(rank: int, system: str, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(STAGES), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29511", ZS_ACCELERATOR="cpu", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=STAGES)
    from gpt import GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**MODEL)
    lib, schedule = system.split("-")
    model, step = (_zerospeed(schedule, config, rank) if lib == "zs" else
                   _deepspeed(config, rank) if lib == "ds" else _torch(schedule, config, rank))
    saved = SavedActivations(list(model.parameters())) if lib == "zs" and rank == 0 else None
    times, cpu, timings = [], [], []
    batches = _batches(config)
    for index, batch in enumerate(batches):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        step(batch)
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            if lib == "zs":
                timings.append(_timing(model.last_batch_timeline))
    # Activation memory is measured on one extra, untimed step: the saved-tensor hooks cost CPU
    # time that the other systems' timed steps would not pay.
    dist.barrier()
    if saved is not None:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            step(batches[-1])
    else:
        step(batches[-1])
    in_flight = saved.peak / (saved.total / M) if saved is not None else 0.0
    local = torch.tensor(timings or [[0.0, 0.0, 0.0]] * len(times), dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(STAGES)]
    dist.all_gather(gathered, local)
    idle = _idle_in_span(torch.stack(gathered)) if lib == "zs" else [0.0] * STAGES
    row = torch.tensor([statistics.median(times), idle[rank], _theory(system, model) if lib == "zs" else 0.0,
                        in_flight, saved.peak / 2**20 if saved else 0.0, statistics.median(cpu),
                        float(local[:, 2].mean())], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(STAGES)]
    dist.all_gather(rows, row)
    finish_rank(results, [r.tolist() for r in rows] if rank == 0 else None)


def run(system: str) -> list[list[float]]:
    return spawn_ranks(_worker, STAGES, system, label=system, timeout_s=1200.0)[0]


def main() -> None:
    global STAGES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--stages", type=int, choices=(2, 4), default=STAGES,
                        help="pipeline stages = ranks (8 blocks split evenly); use no more than the machine's cores "
                             "to measure the schedule's idle fraction")
    args = parser.parse_args()
    STAGES = args.stages
    os.environ["ZS_BENCH_PIPE_STAGES"] = str(STAGES)
    by_system: dict[str, list[list[list[float]]]] = {s: [] for s in args.systems}
    for _ in range(args.rounds):
        for system in args.systems:
            by_system[system].append(run(system))
            print(f"{system}: step {max(r[0] for r in by_system[system][-1]):.3f} s", flush=True)
    step = {s: statistics.median(max(r[0] for r in rows) for rows in runs) for s, runs in by_system.items()}
    cpu = {s: statistics.median(sum(r[5] for r in rows) for rows in runs) for s, runs in by_system.items()}
    print(f"\n{STAGES} stages x 1 thread, gloo; GPT {MODEL}, micro-batch {MICRO}, M={M}; "
          f"{STEPS - WARMUP} measured steps, load average {os.getloadavg()[0]:.1f}")
    print("| system | step s | step / DeepSpeed | step / torch same schedule | CPU s (all ranks) | CPU / DeepSpeed |")
    print("|---|---|---|---|---|---|")
    for system, value in step.items():
        peer = {"1f1b": "pt-1f1b", "gpipe": "pt-gpipe"}.get(system.split("-")[1])
        ratio_ds = f"{value / step['ds-1f1b']:.2f}" if "ds-1f1b" in step and system != "ds-1f1b" else ""
        ratio_pt = f"{value / step[peer]:.2f}" if system.startswith("zs") and peer in step else ""
        cpu_ds = f"{cpu[system] / cpu['ds-1f1b']:.2f}" if "ds-1f1b" in cpu else ""
        print(f"| {system} | {value:.3f} | {ratio_ds} | {ratio_pt} | {cpu[system]:.3f} | {cpu_ds} |")
    rounds = {s: [max(r[0] for r in rows) for rows in runs] for s, runs in by_system.items()}
    for system, peer in (("zs-1f1b", "ds-1f1b"), ("zs-1f1b", "pt-1f1b"), ("zs-gpipe", "pt-gpipe")):
        if system in rounds and peer in rounds:
            print(f"{system} / {peer} per round: " + ", ".join(f"{a / b:.2f}" for a, b in zip(rounds[system], rounds[peer])))
    print("\n| system | stage | idle in span, measured | idle theory | forward + backward s per step "
          "| stage-0 micro-batches in flight (peak) | stage-0 peak saved MiB |")
    print("|---|---|---|---|---|---|---|")
    for system, runs in by_system.items():
        if not system.startswith("zs"):
            continue
        rows = runs[-1]
        for stage, row in enumerate(rows):
            extra = f"{row[3]:.2f} | {row[4]:.1f}" if stage == 0 else " | "
            print(f"| {system} | {stage} | {row[1]:.3f} | {row[2]:.3f} | {row[6]:.3f} | {extra} |")


if __name__ == "__main__":
    main()
