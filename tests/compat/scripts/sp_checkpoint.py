"""Compat script: checkpoints of Ulysses sequence-parallel training (sp = world size), written once
against DeepSpeed's public API.

`main(ds, ctx, stages, load_from=None)`, for each ZeRO stage: a tiny HF Llama with ALST
(`register_with_transformers` + `UlyssesSPDataLoaderAdapter`), AdamW at ZeRO `stage`, two steps,
`save_checkpoint`, two more steps. Reports the losses, the checkpoint's file names,
`zero_to_fp32`'s full weights, the fp32 weights and Adam moments at the save
(`safe_get_full_optimizer_state`) and the weights at the end. With `load_from` ({impl: checkpoint
dir}) it loads that checkpoint instead and reports the weights it then holds, the last two steps'
losses and the weights at the end.

Adam's update is invariant to a constant gradient scale (up to eps), so DeepSpeed's sp-times larger
ZeRO-1 SP gradients (docs/compatibility.md) leave the two trajectories equal to rounding.
"""

from __future__ import annotations

import torch
from tiny_llama import SEQ, VOCAB, tiny_llama, trainer_recipe_loss

LR, STEPS = 1e-2, 2
_REGISTERED: dict = {}


def _samples():
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
        out.append({"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "labels": ids.clone()})
    return out


def _state(ds, ctx, engine):
    utils = ctx.submodule("utils")
    moments = {}
    for name, param in engine.module.named_parameters():
        moments[name] = [ctx.values(utils.safe_get_full_optimizer_state(param, key)) for key in ("exp_avg", "exp_avg_sq")]
        moments[name].append(ctx.values(utils.safe_get_full_fp32_param(param)))
    return moments


def _weights(ctx, engine):
    utils = ctx.submodule("utils")
    return {name: ctx.values(utils.safe_get_full_fp32_param(p)) for name, p in engine.module.named_parameters()}


def _train(engine, batches, group):
    losses = []
    for batch in batches:
        loss = trainer_recipe_loss(engine, batch, group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(ds, ctx, stages, load_from=None):
    ds.init_distributed(dist_backend="gloo")
    return {str(stage): run(ds, ctx, stage, load_from and {impl: f"{path}/s{stage}" for impl, path in load_from.items()})
            for stage in stages}


def run(ds, ctx, stage, load_from):
    alst = ctx.submodule("runtime.sequence_parallel.ulysses_sp")
    net = tiny_llama(num_hidden_layers=1)
    if "mpu" not in _REGISTERED:   # DeepSpeed registers once per process: it swaps transformers' "sdpa"
        _REGISTERED["mpu"] = alst.UlyssesSPAttentionHF.register_with_transformers(
            net, "sdpa", sequence_parallel_size=ctx.world_size, micro_batch_size=1)
    mpu = _REGISTERED["mpu"]
    group = mpu.get_sequence_parallel_group()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}}
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, eps=1e-12)
    engine, *_ = ds.initialize(model=net, optimizer=optimizer, config=config, mpu=mpu)
    loader = alst.UlyssesSPDataLoaderAdapter(_samples(), sp_rank=mpu.get_sequence_parallel_rank(),
                                             sp_group=group, sp_world_size=ctx.world_size, device="cpu")
    batches = list(loader)
    if load_from is not None:
        engine.load_checkpoint(load_from[ctx.impl], tag="t")
        # DeepSpeed maps the moments for safe_get_full_optimizer_state only after a step: weights here.
        weights = _weights(ctx, engine)
        steps, losses = engine.global_steps, _train(engine, batches[2:], group)
        return {"weights": weights, "global_steps": steps, "losses": losses, "end": _weights(ctx, engine)}
    losses = _train(engine, batches[:2], group)
    save_dir = ctx.path("ckpt", f"s{stage}")
    engine.save_checkpoint(save_dir, tag="t")
    state = _state(ds, ctx, engine)
    losses += _train(engine, batches[2:], group)
    end = _weights(ctx, engine)
    full = {}
    if ctx.rank == 0:
        merged = ctx.submodule("utils.zero_to_fp32").get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
        full = {name: ctx.values(value) for name, value in merged.items()}
    return {"losses": losses, "state": state, "full": full, "end": end,
            "files": [f for f in ctx.files(f"{save_dir}/t") if f.endswith(".pt")]}
