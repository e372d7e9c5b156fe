"""Compat script: a model with an MoE layer (ep_size = world size) trained in fp32 at each ZeRO stage
asked for, saved, and optionally resumed from a checkpoint — written once against DeepSpeed's public API.

`main(ds, ctx, steps, load_from=None, stages=(0,))`: for each stage (one engine after the other in
the same processes, so one launch covers them all), without `load_from` train `steps` steps from a
seeded model whose experts get weights drawn from their global id, then
`save_checkpoint(ctx.path(f"ckpt_s{stage}"))`. With `load_from` ({impl: directory holding the
`ckpt_s<stage>` checkpoints}, so each library can be handed the other's), build a fresh engine,
`load_checkpoint` and train `steps` more. Reports, per stage, per-step losses and the parameters
(experts under their global ids) after loading and at the end.
"""

from __future__ import annotations

import os

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


def main(ds, ctx, steps, load_from=None, optimizer="AdamW", stages=(0,)):
    return {str(stage): run_stage(ds, ctx, steps, load_from, optimizer, stage) for stage in stages}


def run_stage(ds, ctx, steps, load_from, optimizer, stage):
    groups = ctx.submodule("utils.groups")

    class Wrapped(torch.nn.Module):       # the engine calls module(x, y)
        def __init__(self):
            super().__init__()
            self.net = make_model(ds, ctx)

        def forward(self, x, y):
            return forward(self.net, x, y)

    # No clipping: DeepSpeed's stage-0 clip norm with MoE is the mean of the ranks' local norms, ours
    # counts every expert once (docs/compatibility.md), so clipped runs differ by design.
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True,
              "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]}}
    wrapped = Wrapped()
    ep_rank = ctx.rank   # ep_size = world size: one expert-parallel group, ranks in order
    if load_from is None:
        # Before initialize: at ZeRO 1/2 DeepSpeed copies its fp32 masters then, later writes are lost.
        with torch.no_grad():
            set_expert_weights(wrapped.net, ep_rank)
    engine, _, _, _ = ds.initialize(model=wrapped, config=config)
    assert groups._get_expert_parallel_rank(f"ep_size_{ctx.world_size}") == ep_rank
    first = 0
    result = {}
    if load_from is not None:
        engine.load_checkpoint(os.path.join(load_from[ctx.impl], f"ckpt_s{stage}"))
        first = engine.global_steps
        result["loaded"] = global_params(ctx, wrapped.net, ep_rank)
    losses = []
    for step in range(first, first + steps):
        loss = engine(*batch(step, ctx.rank, ctx.world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if load_from is None:
        engine.save_checkpoint(ctx.path(f"ckpt_s{stage}"))
    result.update(losses=losses, params=global_params(ctx, wrapped.net, ep_rank))
    return result
