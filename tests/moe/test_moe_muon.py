"""Muon with MoE expert groups: test_moe_engine's model (4 experts, expert parallel over 2 of 2 or 4
gloo ranks) trained with `"type": "Muon"` at ZeRO 0-3 equals the dense model with every expert
local, trained in one process on the global batch with single-process Muon (each expert's
matrices orthogonalized whole; fp32). Expert matrices are owned within their expert-data-parallel
group, dense ones within the data-parallel group.
"""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_on_ranks
from parity import assert_close_relative
from test_moe_engine import CLIP, MICRO, NUM_STEPS, MoEModel, _batches, _shard

import zerospeed

MUON_LR, ADAM_LR, MOMENTUM, EPS = 0.02, 1e-3, 0.9, 1e-3
BLOCK = {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "eps": EPS}


def newton_schulz64(update: torch.Tensor, steps: int) -> torch.Tensor:
    """The plain quintic iteration in float64 (the reference's; none of zerospeed's code)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def _global_name(name: str, ep_rank: int, num_local: int) -> str:
    if "deepspeed_experts." not in name:
        return name
    head, tail = name.split("deepspeed_experts.")
    local, rest = tail.split(".", 1)
    return f"{head}deepspeed_experts.{ep_rank * num_local + int(local)}.{rest}"


def _train(ep_size: int, stage: int) -> dict:
    from zerospeed.utils import groups

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = MoEModel(ep_size, 2, True)
    model.set_expert_weights(rank % ep_size)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
              "optimizer": {"type": "Muon", "params": BLOCK}}
    engine, optimizer, _, _ = zerospeed.initialize(model=model, config=config)
    assert sorted((g["use_muon"], g.get("moe", False)) for g in optimizer.param_groups) == \
        [(False, False), (False, True), (True, False), (True, True)]
    losses = []
    for batch in _batches(world_size, 1):
        loss = engine(*_shard(batch, 0, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ep_rank = groups._get_expert_parallel_rank(model.moe.expert_group_name)
    params = {}
    for name, param in model.named_parameters():
        with zerospeed.zero.GatheredParameters([param]):   # a no-op below stage 3
            params[_global_name(name, ep_rank, model.moe.num_local_experts)] = param.detach().clone()
    return {"losses": losses, "params": params, "calls": engine.basic_optimizer.newton_schulz_calls}


def _reference(world_size: int) -> dict:
    model = MoEModel(1, 2, True)
    model.set_expert_weights(0)
    named = dict(model.named_parameters())
    muon = [n for n, p in named.items() if p.dim() >= 2]
    adam = torch.optim.AdamW([p for n, p in named.items() if n not in muon], lr=ADAM_LR, betas=(0.9, 0.95),
                             eps=EPS, weight_decay=0.0)
    buffers = {n: torch.zeros_like(named[n]) for n in muon}
    losses = []
    for batch in _batches(world_size, 1):
        shard_losses = [model(*_shard(batch, 0, r, world_size)) for r in range(world_size)]
        (sum(shard_losses) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for name in muon:
                p = named[name]
                buffers[name] = MOMENTUM * buffers[name] + (1 - MOMENTUM) * p.grad
                blended = (1 - MOMENTUM) * p.grad + MOMENTUM * buffers[name]
                rows, cols = p.shape
                p.sub_(MUON_LR * newton_schulz64(blended, 5) * math.sqrt(max(1.0, rows / cols)))
        adam.step()
        model.zero_grad()
        losses.append([loss.item() for loss in shard_losses])
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named.items()}, "num_muon": len(muon)}


@pytest.mark.parametrize("world_size,stage", [(2, 0), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_moe_muon_equals_dense_single_process_muon(world_size: int, stage: int) -> None:
    results = run_on_ranks(_train, world_size, 2, stage)
    expected = _reference(world_size)
    for rank, result in enumerate(results):
        want = torch.tensor([expected["losses"][s][rank] for s in range(NUM_STEPS)])
        assert_close_relative(torch.tensor(result["losses"]), want, 1e-5, f"rank {rank} losses")
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected["params"][name], rtol=0, atol=1e-5, msg=name)
    assert set().union(*(r["params"] for r in results)) == set(expected["params"])
    # Every matrix, dense or one expert's, was orthogonalized whole exactly once per step somewhere
    # (an expert's by one rank of the expert-data-parallel group holding it), every rank doing part.
    assert sum(r["calls"] for r in results) == NUM_STEPS * expected["num_muon"]
    assert all(r["calls"] > 0 for r in results)
