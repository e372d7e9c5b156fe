"""Compat script: universal checkpoints, written once against DeepSpeed's public API.

`main(ds, ctx, cases, steps, resume_steps, load_root=None)` runs each case (`stage`, fp32, a
WarmupDecayLR scheduler) on a tiny MLP with a global batch of GLOBAL rows, whatever the world size:

* without `load_root`: `steps` steps, `save_checkpoint(ctx.path(name))`, then `resume_steps` more
  (the uninterrupted run a resumed one must reproduce);
* with `load_root`: a fresh engine (other initial weights) with `"checkpoint": {"load_universal":
  true}`, `load_checkpoint(<load_root>/<name>)` (the tag from `latest_universal`), then
  `resume_steps` steps.

Each case reports the global loss per step (all-reduced mean), lr, scheduler state, global_steps and
full parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from seeded_batch import seeded_batch

IN, HIDDEN, OUT, GLOBAL = 8, 16, 4, 4


def case_name(case: dict) -> str:
    return f"stage{case['stage']}"


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def config(case: dict, world_size: int, universal: bool) -> dict:
    zero = {"stage": case["stage"]}
    if case["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world_size,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99],
                                                     "torch_adam": True}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                             "warmup_num_steps": 3, "total_num_steps": 10}},
           "zero_optimization": zero}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def full_params(ds, ctx, engine) -> dict:
    params = list(engine.module.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in params]):
        return {name: ctx.values(p) for name, p in params}


def train(ctx, engine, first: int, count: int) -> list[dict]:
    records = []
    micro = GLOBAL // ctx.world_size
    for step in range(first, first + count):
        x, y = seeded_batch(step, ctx.rank, ctx.world_size, micro=micro, in_features=IN, out_features=OUT)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        records.append({"loss": mean.item() / ctx.world_size, "lr": engine.get_lr()[0]})
    return records


def run_case(ds, ctx, case: dict, steps: int, resume_steps: int, load_root: str | None) -> dict:
    engine, _, _, _ = ds.initialize(model=make_model(0 if load_root is None else 7),
                                    config=config(case, ctx.world_size, load_root is not None))
    name = case_name(case)
    result: dict = {"name": name}
    if load_root is None:
        result["steps"] = train(ctx, engine, 0, steps)
        engine.save_checkpoint(ctx.path(name))
    else:
        try:
            engine.load_checkpoint(f"{load_root}/{name}")
        except Exception as error:  # noqa: BLE001 - reported, so the other cases still run
            return {"name": name, "error": type(error).__name__, "message": str(error)[-800:]}
    result["global_steps"] = engine.global_steps
    result["scheduler"] = engine.lr_scheduler.state_dict()
    result["lr"] = engine.get_lr()[0]
    result["params_saved"] = full_params(ds, ctx, engine)
    result["continued"] = train(ctx, engine, steps, resume_steps)
    result["params"] = full_params(ds, ctx, engine)
    return result


def main(ds, ctx, cases: list[dict], steps: int, resume_steps: int, load_root: str | None = None) -> dict:
    return {case_name(case): run_case(ds, ctx, case, steps, resume_steps, load_root) for case in cases}
