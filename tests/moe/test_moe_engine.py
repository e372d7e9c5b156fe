"""A model with an MoE layer trained through `zerospeed.initialize` on 2 / 4 gloo ranks equals the same
model with every expert local, trained in one process on the global batch (losses, gradient norm,
parameters after several SGD steps, gradient clipping active; SGD, not Adam, so that a wrongly
scaled gradient shows).

The reference runs the layer on each rank's micro-batch separately — the capacity and l_aux of an
MoE layer are per call — and averages the losses over all (rank, micro-step) shards, which is what
the engine's gradient averaging computes ([Note: expert gradient reduction]).
"""

from __future__ import annotations


import pytest
import torch
from distributed import run_on_ranks
from parity import assert_close_relative

import zerospeed
from zerospeed.moe.layer import MoE

D_IN, D_MODEL, D_HIDDEN, D_OUT, NUM_EXPERTS = 5, 8, 12, 3, 4
NUM_STEPS, MICRO, LR, CLIP, AUX_COEF = 3, 8, 0.5, 0.05, 0.1


class MoEModel(torch.nn.Module):
    def __init__(self, ep_size: int, k: int, drop_tokens: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D_IN, D_MODEL)
        expert = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(D_HIDDEN, D_MODEL))
        self.moe = MoE(D_MODEL, expert, NUM_EXPERTS, ep_size, k, capacity_factor=1.0, min_capacity=1,
                       drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False,
                       drop_policy="position" if k == 1 else None)
        self.head = torch.nn.Linear(D_MODEL, D_OUT)

    @torch.no_grad()
    def set_expert_weights(self, ep_rank: int) -> None:
        """Expert i of this rank gets weights drawn from its global id (distinct experts); in place, since
        at ZeRO 1/2 the parameters are views of the flat buffers."""
        local = self.moe.num_local_experts
        for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            generator = torch.Generator().manual_seed(100 + ep_rank * local + i)
            for param in expert.parameters():
                param.data.copy_(torch.randn(param.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        out, l_aux, _ = self.moe(hidden)
        return torch.nn.functional.mse_loss(self.head(out + hidden), y) + AUX_COEF * l_aux


def _batches(world_size: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    rows = MICRO * gas * world_size
    return [(torch.randn(rows, D_IN, generator=generator), torch.randn(rows, D_OUT, generator=generator))
            for _ in range(NUM_STEPS)]


def _shard(batch: tuple, micro_step: int, rank: int, world_size: int) -> tuple:
    start = (micro_step * world_size + rank) * MICRO
    return batch[0][start:start + MICRO], batch[1][start:start + MICRO]


def _train(ep_size: int, k: int, drop_tokens: bool, gas: int, stage: int, offload: bool = False) -> dict:
    from zerospeed.utils import groups

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = MoEModel(ep_size, k, drop_tokens)
    # Before initialize (stage 3 partitions the parameters there): expert-parallel groups are
    # consecutive ranks, so this rank's ep rank is rank % ep_size (checked below).
    model.set_expert_weights(rank % ep_size)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "gradient_clipping": CLIP,   # stage 3: nothing persistent, every module gathers and releases
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
                                    **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
              "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
    engine, optimizer, _, _ = zerospeed.initialize(model=model, config=config)
    assert groups._get_expert_parallel_rank(model.moe.expert_group_name) == rank % ep_size
    assert (getattr(engine.optimizer, "offload", None) is not None) == offload
    assert engine.has_moe_layers and engine.num_experts == [NUM_EXPERTS]
    assert [g.get("moe", False) for g in optimizer.param_groups] == [False, True]
    losses, norms = [], []
    for batch in _batches(world_size, gas):
        for micro_step in range(gas):
            loss = engine(*_shard(batch, micro_step, rank, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    ep_rank = groups._get_expert_parallel_rank(model.moe.expert_group_name)
    params = {}
    for name, param in model.named_parameters():
        if "deepspeed_experts." in name:  # rename local expert i to its global id
            head, tail = name.split("deepspeed_experts.")
            local, rest = tail.split(".", 1)
            name = f"{head}deepspeed_experts.{ep_rank * model.moe.num_local_experts + int(local)}.{rest}"
        with zerospeed.zero.GatheredParameters([param]):   # a no-op below stage 3
            params[name] = param.detach().clone()
    return {"losses": losses, "norms": norms, "params": params}


def _reference(world_size: int, k: int, drop_tokens: bool, gas: int) -> dict:
    model = MoEModel(1, k, drop_tokens)
    model.set_expert_weights(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for batch in _batches(world_size, gas):
        shard_losses = [[model(*_shard(batch, m, r, world_size)) for r in range(world_size)] for m in range(gas)]
        (sum(sum(row) for row in shard_losses) / (world_size * gas)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append([[loss.item() for loss in row] for row in shard_losses])
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _check(results: list[dict], expected: dict, world_size: int, gas: int) -> None:
    for rank, result in enumerate(results):
        got = torch.tensor(result["losses"]).view(NUM_STEPS, gas)
        want = torch.tensor([[expected["losses"][s][m][rank] for m in range(gas)] for s in range(NUM_STEPS)])
        assert_close_relative(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), 1e-5, "grad norms")
        assert_close_relative(got, want, 1e-5, f"rank {rank} losses")
        for name, value in result["params"].items():
            assert_close_relative(value, expected["params"][name], 1e-5, f"rank {rank} {name}")
    assert min(expected["norms"]) > CLIP, "clipping must be active for the norm to matter"
    covered = set().union(*(r["params"] for r in results))
    assert covered == set(expected["params"]), "every expert is held by some rank"


@pytest.mark.parametrize("world_size,ep_size,k,drop_tokens,gas,stage", [
    (2, 2, 1, True, 1, 0), (2, 2, 2, False, 2, 0), (4, 2, 2, True, 1, 0), (4, 4, 1, False, 1, 0),
    (2, 2, 2, True, 2, 1), (4, 2, 1, True, 1, 1), (2, 2, 1, False, 1, 2), (4, 2, 2, True, 2, 2),
    (4, 2, 2, False, 2, 3)])   # stage 3 dropless: experts that get no rows on a rank still gather
def test_moe_training_equals_dense_single_process(world_size: int, ep_size: int, k: int, drop_tokens: bool,
                                                  gas: int, stage: int) -> None:
    results = run_on_ranks(_train, world_size, ep_size, k, drop_tokens, gas, stage)
    _check(results, _reference(world_size, k, drop_tokens, gas), world_size, gas)


@pytest.mark.parametrize("stage", [2, 3])
def test_moe_training_with_optimizer_offload_equals_dense(stage: int) -> None:
    """offload_optimizer: the expert groups' fp32 masters and momentum live in host memory, stepped there."""
    results = run_on_ranks(_train, 4, 2, 2, True, 1, stage, True)
    _check(results, _reference(4, 2, True, 1), 4, 1)


def _stage3_zero_init() -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with zerospeed.zero.Init(config_dict_or_path=config):
        model = MoEModel(2, 1, True)
    with pytest.raises(ValueError, match="expert parameter .* was partitioned by zero.Init"):
        zerospeed.initialize(model=model, config=config)


def test_stage3_moe_built_under_zero_init_is_a_clear_error() -> None:
    run_on_ranks(_stage3_zero_init, 2)


def _unsplit_client_optimizer() -> None:
    model = MoEModel(2, 1, True)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match="not marked as MoE"):
        zerospeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)


def test_zero_needs_moe_param_groups() -> None:
    run_on_ranks(_unsplit_client_optimizer, 2)


