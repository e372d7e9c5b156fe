"""Compat script: train, save, optionally resume — written once against DeepSpeed's public API.

`main(ds, ctx, cases, steps, load_from=None, resume_steps=0)` runs each case (a dict with
`stage`, `dtype` and optional `offload`, `scheduler`, `clip`) on a tiny MLP: `steps` training
steps, then `save_checkpoint(ctx.path(name))`. With `load_from` it instead builds a fresh engine,
`load_checkpoint(load_from/<name>)` and trains `resume_steps` more steps. Each case reports the
per-step loss, global grad norm and lr, and the final full parameters.
"""

from __future__ import annotations

import torch

IN, HIDDEN, OUT, MICRO = 8, 16, 4, 2
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def case_name(case: dict) -> str:
    extra = "-".join(f"{k}" for k in ("offload", "scheduler", "clip") if case.get(k))
    return f"stage{case['stage']}-{case['dtype']}" + (f"-{extra}" if extra else "")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def config(case: dict, world_size: int) -> dict:
    offload = case.get("offload")
    zero = {"stage": case["stage"]}
    if case["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    adam = {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99]}
    if not offload:
        adam["torch_adam"] = True   # DeepSpeed's fused Adam needs a CUDA build; offload uses its CPU Adam
    cfg = {"train_batch_size": MICRO * world_size, "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": adam}, "zero_optimization": zero,
           **PRECISION[case["dtype"]]}
    if case.get("scheduler"):
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3, "total_num_steps": 10}}
    if case.get("clip"):
        cfg["gradient_clipping"] = case["clip"]
    return cfg


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(MICRO * world_size, IN, generator=generator)
    y = torch.randn(MICRO * world_size, OUT, generator=generator)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    return x[rows], y[rows]


def full_params(ds, ctx, engine) -> dict:
    params = list(engine.module.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in params]):
        return {name: ctx.values(p) for name, p in params}


def train(ds, ctx, engine, first: int, count: int) -> list[dict]:
    dtype = next(engine.module.parameters()).dtype
    records = []
    for step in range(first, first + count):
        x, y = batch(step, ctx.rank, ctx.world_size)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        records.append({"loss": loss.item(), "grad_norm": None if norm is None else float(norm),
                        "lr": engine.get_lr()[0]})
    return records


def run_case(ds, ctx, case: dict, steps: int, load_from: str | None, resume_steps: int) -> dict:
    engine, _, _, _ = ds.initialize(model=make_model(), config=config(case, ctx.world_size))
    name = case_name(case)
    result: dict = {"name": name}
    if load_from is None:
        result["steps"] = train(ds, ctx, engine, 0, steps)
        engine.save_checkpoint(ctx.path(name))
        result["files"] = ctx.files(ctx.path(name))
    else:
        path, client = engine.load_checkpoint(f"{load_from}/{name}")
        result["loaded"] = path is not None
        result["global_steps"] = engine.global_steps
        result["params_loaded"] = full_params(ds, ctx, engine)
        result["steps"] = train(ds, ctx, engine, steps, resume_steps)
    result["params"] = full_params(ds, ctx, engine)
    return result


def main(ds, ctx, cases: list[dict], steps: int, load_from: str | None = None, resume_steps: int = 0) -> dict:
    return {case_name(case): run_case(ds, ctx, case, steps, load_from, resume_steps) for case in cases}
