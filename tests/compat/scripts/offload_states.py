"""Compat script: `engine.offload_states()` / `reload_states()` between steps, written against DeepSpeed's API.

`main(ds, ctx, stage, bf16, include, non_blocking)` trains a small MLP for two steps, offloads the
included states (None: all), reloads them and trains two more steps. It reports the losses, where
each state type's tensors were while offloaded (DeepSpeed's own `get_state_devices` helper is
not used: it is DeepSpeed-only), the final weights, and the type name of any error raised by the
offload or the reload, so the test can compare both libraries phase by phase.
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


def main(ds, ctx, stage: int = 1, bf16: bool = False, include: list[str] | None = None,
         non_blocking: bool = False) -> dict:
    enums = ctx.submodule("runtime.zero.offload_config")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
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
