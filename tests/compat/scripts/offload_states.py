"""Compat script: `engine.offload_states()` / `reload_states()` between steps, written against DeepSpeed's API.

`main(ds, ctx, cases)` runs each case (stage, bf16, include, non_blocking): it trains a small MLP
for two steps, offloads the included states (None: all), reloads them and trains two more steps. It reports the losses, the final
weights, and the error (type and message) raised by the offload, the reload or an NVMe offload,
so the test can compare both libraries phase by phase.
"""

from __future__ import annotations

import functools

import torch
from seeded_batch import seeded_batch

IN, HIDDEN, OUT, MICRO = 8, 16, 4, 2

batch = functools.partial(seeded_batch, micro=MICRO, in_features=IN, out_features=OUT)


def config(world_size: int, stage: int, bf16: bool) -> dict:
    result = {"train_batch_size": MICRO * world_size, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    if bf16:
        result["bf16"] = {"enabled": True}
    return result


def step(engine, ctx, index: int) -> float:
    x, y = batch(index, ctx.rank, ctx.world_size)
    x = x.to(next(engine.module.parameters()).dtype)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _error(fn, **kwargs) -> str | None:
    try:
        fn(**kwargs)
    except Exception as error:  # noqa: BLE001 - the type is the result
        return f"{type(error).__name__}: {error}"
    return None


def run_case(ds, ctx, stage: int, bf16: bool, include: list[str] | None, non_blocking: bool) -> dict:
    enums = ctx.submodule("runtime.zero.offload_config")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    if bf16:
        model = model.to(torch.bfloat16)
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(),
                                    config=config(ctx.world_size, stage, bf16))
    losses = [step(engine, ctx, i) for i in range(2)]
    states = None if include is None else [enums.OffloadStateTypeEnum(name) for name in include]
    offload_error = _error(engine.offload_states, include=states, device=enums.OffloadDeviceEnum.cpu,
                           pin_memory=True, non_blocking=non_blocking)
    reload_error = _error(engine.reload_states, non_blocking=non_blocking)
    losses += [step(engine, ctx, i) for i in range(2, 4)]
    weights = {}
    for name, param in engine.module.named_parameters():
        if stage == 3:
            with ds.zero.GatheredParameters(param):
                weights[name] = ctx.values(param)
        else:
            weights[name] = ctx.values(param)
    return {"losses": losses, "offload_error": offload_error, "reload_error": reload_error, "weights": weights,
            "nvme_error": _error(engine.offload_states, device=enums.OffloadDeviceEnum.nvme)}


def main(ds, ctx, cases: dict[str, dict]) -> dict:
    """`cases`: name -> run_case's keyword arguments; one engine after another in this process."""
    return {name: run_case(ds, ctx, **kwargs) for name, kwargs in cases.items()}
