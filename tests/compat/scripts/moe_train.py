"""Compat script: a model with an MoE layer (ep_size = world size) trained at ZeRO stage 0 in fp32,
saved, and optionally resumed from a checkpoint — written once against DeepSpeed's public API.

`main(ds, ctx, steps, load_from=None)`: without `load_from`, train `steps` steps from a seeded
model whose experts get weights drawn from their global id, then `save_checkpoint(ctx.path("ckpt"))`.
With `load_from` ({impl: checkpoint dir}, so each library can be handed the other's), build a
fresh engine, `load_checkpoint` and train `steps` more. Reports per-step losses and the parameters
(experts under their global ids) after loading and at the end.
"""

from __future__ import annotations

import torch

D_IN, D_MODEL, D_HIDDEN, D_OUT, NUM_EXPERTS, MICRO = 5, 8, 12, 3, 4, 8


def make_model(ds, ctx):
    layer = ctx.submodule("moe.layer")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "inp": torch.nn.Linear(D_IN, D_MODEL),
        "moe": layer.MoE(D_MODEL, torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(),
                                                      torch.nn.Linear(D_HIDDEN, D_MODEL)),
                         num_experts=NUM_EXPERTS, ep_size=ctx.world_size, k=2, min_capacity=1,
                         top2_2nd_expert_sampling=False),
        "head": torch.nn.Linear(D_MODEL, D_OUT)})
    return model


def forward(model, x, y):
    hidden = torch.tanh(model["inp"](x))
    out, l_aux, _ = model["moe"](hidden)
    return torch.nn.functional.mse_loss(model["head"](out + hidden), y) + 0.1 * l_aux


def set_expert_weights(model, ep_rank):
    moe = model["moe"]
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        generator = torch.Generator().manual_seed(100 + ep_rank * moe.num_local_experts + i)
        for param in expert.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def global_params(ctx, model, ep_rank):
    named = {}
    local = model["moe"].num_local_experts
    for name, param in model.named_parameters():
        if "deepspeed_experts." in name:
            head, tail = name.split("deepspeed_experts.")
            index, rest = tail.split(".", 1)
            name = f"{head}deepspeed_experts.{ep_rank * local + int(index)}.{rest}"
        named[name] = ctx.values(param)
    return named


def batch(step, rank, world_size):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(MICRO * world_size, D_IN, generator=generator)
    y = torch.randn(MICRO * world_size, D_OUT, generator=generator)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    return x[rows], y[rows]


OPTIMIZERS = {"AdamW": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}, "SGD": {"lr": 0.2, "momentum": 0.9}}


def main(ds, ctx, steps, load_from=None, optimizer="AdamW"):
    groups = ctx.submodule("utils.groups")

    class Wrapped(torch.nn.Module):       # the engine calls module(x, y)
        def __init__(self):
            super().__init__()
            self.net = make_model(ds, ctx)

        def forward(self, x, y):
            return forward(self.net, x, y)

    # No clipping: DeepSpeed's stage-0 clip norm with MoE is the mean of the ranks' local norms, ours
    # counts every expert once (docs/compatibility.md), so clipped runs differ by design.
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
              "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]}}
    wrapped = Wrapped()
    engine, _, _, _ = ds.initialize(model=wrapped, config=config)
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ctx.world_size}")
    first = 0
    result = {}
    if load_from is None:
        with torch.no_grad():
            set_expert_weights(wrapped.net, ep_rank)
    else:
        engine.load_checkpoint(load_from[ctx.impl])
        first = engine.global_steps
        result["loaded"] = global_params(ctx, wrapped.net, ep_rank)
    losses = []
    for step in range(first, first + steps):
        loss = engine(*batch(step, ctx.rank, ctx.world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if load_from is None:
        engine.save_checkpoint(ctx.path("ckpt"))
    result.update(losses=losses, params=global_params(ctx, wrapped.net, ep_rank))
    return result
