"""The rank side of bench_moe.py: a compat-harness script (`main(ds, ctx, **params)`, written once
against DeepSpeed's public API) that trains a model with MoE layers and times its steps.

With `phases=True` it also records, per rank, the resident memory of each phase of a step
(`initialize`, forward, backward, step): the RSS when the phase starts, its peak (Linux's VmHWM,
reset before the phase through /proc/self/clear_refs) and the RSS when it ends, for the first step
and the largest over the later ones (the first step creates the optimizer state, and what the
allocator keeps from its transients stays resident). That attributes a difference in peak RSS to
the phase that causes it.
"""

from __future__ import annotations

import functools
import re
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_MIB = 1024.0


def _status_kib(field: str) -> float:
    with open("/proc/self/status") as handle:
        match = re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:   # "5": reset the peak RSS (VmHWM)
        handle.write("5")


class _PhaseMemory:
    """Per phase: (start, peak, end) RSS in MiB of the first call, and the largest of each over the later ones."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self.first: dict[str, dict[str, float]] = {}
        self.history: list[tuple[str, float, float, float]] = []   # every call, in order

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        start = _status_kib("VmRSS")
        _reset_peak()
        result = fn()
        values = {"start": start / _MIB, "peak": _status_kib("VmHWM") / _MIB, "end": _status_kib("VmRSS") / _MIB}
        self.history.append((name, values["start"], values["peak"], values["end"]))
        if name not in self.first:
            self.first[name] = values
            return result
        seen = self.phases.setdefault(name, {"start": 0.0, "peak": 0.0, "end": 0.0})
        for key, value in values.items():
            seen[key] = max(seen[key], value)
        return result


def _model(layer_mod, d_model: int, num_experts: int, ep_size: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(d_model, d_model)
            expert = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                         torch.nn.Linear(4 * d_model, d_model))
            self.moes = torch.nn.ModuleList(layer_mod.MoE(d_model, expert, num_experts=num_experts, ep_size=ep_size,
                                                          k=2, capacity_factor=1.25, min_capacity=4,
                                                          top2_2nd_expert_sampling=False) for _ in range(layers))
            self.head = torch.nn.Linear(d_model, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            hidden, aux = torch.tanh(self.inp(x)), 0.0
            for moe in self.moes:
                out, l_aux, _ = moe(hidden)
                hidden, aux = hidden + out, aux + l_aux
            return torch.nn.functional.mse_loss(self.head(hidden), y) + 0.01 * aux

    return Net()


def main(ds, ctx, stage: int, steps: int, warmup: int, tokens: int, d_model: int, num_experts: int,
         layers: int, phases: bool = False) -> dict:
    torch.set_num_threads(1)
    memory = _PhaseMemory()
    config = {"train_micro_batch_size_per_gpu": tokens, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    baseline = _status_kib("VmRSS") / _MIB   # the imported libraries, before the model

    def build() -> Any:
        model = _model(ctx.submodule("moe.layer"), d_model, num_experts, ctx.world_size, layers)
        return ds.initialize(model=model, config=config)[0]

    engine = memory.run("initialize", build) if phases else build()
    generator = torch.Generator().manual_seed(ctx.rank)
    times, cpu_times, losses = [], [], []
    for _ in range(warmup + steps):
        x, y = torch.randn(tokens, d_model, generator=generator), torch.randn(tokens, 1, generator=generator)
        torch.distributed.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        if phases:   # every step, warm-up included (the first step creates the optimizer state)
            loss = memory.run("forward", functools.partial(engine, x, y))
            memory.run("backward", functools.partial(engine.backward, loss))
            memory.run("step", engine.step)
        else:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(loss.item())
    # With phases the kernel's peak was reset before each phase: the process peak is the phases' largest.
    peak = max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                *(seen["peak"] for table in (memory.first, memory.phases) for seen in table.values())])
    return {"step_s": statistics.median(times[warmup:]), "cpu_s": statistics.median(cpu_times[warmup:]),
            "losses": losses, "baseline_rss_mib": baseline, "first_phases": memory.first,
            "phases": memory.phases, "history": memory.history, "peak_rss_mib": peak}
