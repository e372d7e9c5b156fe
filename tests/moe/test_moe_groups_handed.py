"""The engine hands each MoE layer its groups from the run's frozen groups: with every by-name group
lookup of DeepSpeed's registry made to fail, `initialize` and a training step still run at stages 0
and 2, and each layer's expert-parallel group is the run's."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

import zerospeed
from zerospeed.comm import groups
from zerospeed.moe.layer import MoE

_BY_NAME = ("_get_expert_parallel_group", "_get_expert_data_parallel_group", "_get_expert_parallel_group_dict",
            "_get_expert_parallel_group_ranks", "_get_expert_data_parallel_group_ranks",
            "_get_expert_parallel_world_size", "_get_expert_data_parallel_world_size",
            "_create_expert_and_data_parallel")


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2, min_capacity=2)
        self.narrow = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=1, min_capacity=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.wide(x)
        out2, l_aux2, _ = self.narrow(out)
        return out2.square().mean() + l_aux + l_aux2


def _fail(name: str):
    def lookup(*args, **kwargs):
        raise AssertionError(f"MoE group looked up by name through the registry: {name}{args}")
    return lookup


def _train(stage: int) -> list[bool]:
    from zerospeed.utils import groups as ds_groups

    patch = pytest.MonkeyPatch()
    try:
        for name in _BY_NAME:
            patch.setattr(groups, name, _fail(name))
            patch.setattr(ds_groups, name, _fail(name))
        patch.setattr(MoE, "set_deepspeed_parallelism", _fail("MoE.set_deepspeed_parallelism"))
        model = _Model()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = zerospeed.initialize(model=model, config=config)
        loss = engine(torch.randn(2, 3, 4))
        engine.backward(loss)
        engine.step()
        run = engine.run_groups
        return [model.wide.deepspeed_moe.ep_group is run.expert("ep_size_2").expert_parallel.group,
                model.narrow.deepspeed_moe.ep_group is run.expert("ep_size_1").expert_parallel.group,
                bool(torch.isfinite(loss))]
    finally:
        patch.undo()


@pytest.mark.parametrize("stage", [0, 2])
def test_moe_layers_get_their_groups_without_lookups(stage):
    assert run_on_ranks(_train, 2, stage) == [[True, True, True]] * 2
