"""Compat script: Ulysses on 2 ranks, written once against DeepSpeed's public API.

`main(ds, ctx)`: (1) `deepspeed.sequence.layer.DistributedAttention` on a fixed GQA input
(batch-first, causal SDPA): output and q/k/v gradients; (2) ALST on a tiny HF Llama:
`register_with_transformers` + `UlyssesSPDataLoaderAdapter` + the loss recipe transformers'
Trainer uses under sp, one SGD step at ZeRO 1. Reports the loss and the parameter update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_llama import HEADS, KV_HEADS, SEQ, VOCAB, tiny_llama, trainer_recipe_loss

LR = 0.5


def _sdpa(q, k, v):  # [b, s, h, d], KV heads repeated for GQA
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def attention(ctx, group):
    layer = ctx.submodule("sequence.layer")
    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(2, SEQ, h, 4, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    weight = torch.randn(2, SEQ, HEADS, 4, generator=gen)
    mine = [t.chunk(ctx.world_size, dim=1)[ctx.rank].clone().requires_grad_(True) for t in full]
    out = layer.DistributedAttention(_sdpa, group)(*mine, 0)
    (out * weight.chunk(ctx.world_size, dim=1)[ctx.rank]).sum().backward()
    return [ctx.values(out)] + [ctx.values(t.grad) for t in mine]


def sample(rank):
    gen = torch.Generator().manual_seed(3 + rank)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "labels": labels}


def main(ds, ctx):
    ds.init_distributed(dist_backend="gloo")
    alst = ctx.submodule("runtime.sequence_parallel.ulysses_sp")
    net = tiny_llama(num_hidden_layers=2)
    before = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    mpu = alst.UlyssesSPAttentionHF.register_with_transformers(net, "sdpa", sequence_parallel_size=ctx.world_size,
                                                               micro_batch_size=1)
    group = mpu.get_sequence_parallel_group()
    result = {"attention": attention(ctx, group)}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1}}
    engine, *_ = ds.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), config=config, mpu=mpu)
    loader = alst.UlyssesSPDataLoaderAdapter([sample(ctx.rank)], sp_rank=mpu.get_sequence_parallel_rank(),
                                             sp_group=group, sp_world_size=ctx.world_size, device="cpu")
    loss = trainer_recipe_loss(engine, next(iter(loader)), group)
    engine.backward(loss)
    engine.step()
    after = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    result.update(loss=loss.item(), update=ctx.values(after - before))
    return result
