"""The rank side of bench_moe.py: a compat-harness script (`main(ds, ctx, **params)`, written once
against DeepSpeed's public API) that trains a model with MoE layers and times its steps."""

from __future__ import annotations

import resource
import statistics
import time

import torch


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
         layers: int) -> dict:
    torch.set_num_threads(1)
    model = _model(ctx.submodule("moe.layer"), d_model, num_experts, ctx.world_size, layers)
    config = {"train_micro_batch_size_per_gpu": tokens, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = ds.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(ctx.rank)
    times, cpu_times, losses = [], [], []
    for _ in range(warmup + steps):
        x, y = torch.randn(tokens, d_model, generator=generator), torch.randn(tokens, 1, generator=generator)
        torch.distributed.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(loss.item())
    return {"step_s": statistics.median(times[warmup:]), "cpu_s": statistics.median(cpu_times[warmup:]),
            "losses": losses,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
