"""Compat script: zero.Init with a config and GatheredParameters, written against DeepSpeed's API.

`main(ds, ctx)` builds small models under `zero.Init(config_dict_or_path=...)` (a dict, a JSON
file, a config with the "auto" values transformers leaves before it knows the hidden size),
reports what each parameter looks like, writes inside `GatheredParameters` with and without
`modifier_rank`, then trains under `initialize` with persistent (small) parameters and writes into
one of them between steps. Every number is reported so the test can compare both libraries.
"""

from __future__ import annotations

import functools
import json

import torch
from seeded_batch import seeded_batch

IN, HIDDEN, OUT, MICRO = 8, 16, 4, 2


def base_config(world_size: int) -> dict:
    return {"train_batch_size": MICRO * world_size, "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": 3}}


def hf_midway_config(world_size: int) -> dict:
    """transformers' config when from_pretrained calls zero.Init: batch filled, hidden-size keys not yet."""
    config = base_config(world_size)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"].update(reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                                       stage3_param_persistence_threshold="auto")
    return config


def make_model(ds, config) -> torch.nn.Module:
    torch.manual_seed(0)
    with ds.zero.Init(config_dict_or_path=config):
        return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def describe(model) -> dict:
    return {name: {"numel": p.numel(), "ds_numel": p.ds_numel, "ds_shape": list(p.ds_shape),
                   "ds_tensor": p.ds_tensor.numel(), "ds_persist": bool(p.ds_persist), "dtype": str(p.dtype),
                   "status": p.ds_status.name} for name, p in model.named_parameters()}


def full(ds, ctx, model) -> dict:
    params = list(model.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in params]):
        return {name: ctx.values(p) for name, p in params}


def write_inside_gathered(ds, ctx, model, modifier_rank) -> dict:
    for param in model.parameters():
        with ds.zero.GatheredParameters(param, modifier_rank=modifier_rank):
            with torch.no_grad():
                param.fill_(float(ctx.rank + 5))
    return {"after": full(ds, ctx, model), "status": describe(model)}


batch = functools.partial(seeded_batch, micro=MICRO, in_features=IN, out_features=OUT)   # (step, rank, world_size)


def step(engine, ctx, index: int) -> float:
    x, y = batch(index, ctx.rank, ctx.world_size)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def train_with_writes(ds, ctx) -> dict:
    """Persistent params (all of them: the default threshold is 100k) and writes between steps."""
    model = make_model(ds, base_config(ctx.world_size))
    engine, *_ = ds.initialize(model=model, config=base_config(ctx.world_size))
    losses = [step(engine, ctx, 0)]
    bias = model[2].bias
    with ds.zero.GatheredParameters(bias):  # discarded in DeepSpeed, persistent or not
        with torch.no_grad():
            bias.zero_()
    losses += [step(engine, ctx, 1), step(engine, ctx, 2)]
    before_write = full(ds, ctx, model)
    with ds.zero.GatheredParameters(bias, modifier_rank=0):  # rank 0's value, on every rank
        with torch.no_grad():
            bias.fill_(float(ctx.rank + 1))
    after_write = full(ds, ctx, model)
    losses += [step(engine, ctx, 3)]
    return {"losses": losses, "before_write": before_write, "after_write": after_write,
            "params": full(ds, ctx, model), "persist": describe(model)}


def main(ds, ctx) -> dict:
    path = ctx.path(f"ds_config_{ctx.rank}.json")
    with open(path, "w") as handle:
        json.dump(base_config(ctx.world_size), handle)
    result = {
        "dict": describe(make_model(ds, base_config(ctx.world_size))),
        "path": describe(make_model(ds, path)),
        "hf_midway": describe(make_model(ds, hf_midway_config(ctx.world_size))),
    }
    all_auto = {**hf_midway_config(ctx.world_size), "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    result["all_auto_error"] = ctx.error_name(make_model, ds, all_auto)
    model = make_model(ds, base_config(ctx.world_size))
    result["initial"] = full(ds, ctx, model)
    result["write_no_modifier"] = write_inside_gathered(ds, ctx, model, None)
    result["write_modifier_0"] = write_inside_gathered(ds, ctx, model, 0)
    result["training"] = train_with_writes(ds, ctx)
    return result
