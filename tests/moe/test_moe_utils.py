"""Expert-parameter marking and DeepSpeed's optimizer param-group split for MoE."""

from __future__ import annotations

import pytest
import torch

from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)


def test_expert_params_are_marked_and_found() -> None:
    net = _Net()
    assert has_moe_layers(net) == (True, 2)
    expert_names = {n for n, p in net.named_parameters() if is_moe_param(p)}
    assert expert_names == {f"moe.deepspeed_moe.experts.deepspeed_experts.0.{w}" for w in ("weight", "bias")}
    assert all(p.group_name == "ep_size_2" for p in net.parameters() if is_moe_param(p))


def test_split_keeps_hyperparameters_and_names_groups_after_the_expert_group() -> None:
    net = _Net()
    dense = [p for p in net.parameters() if not is_moe_param(p)]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(net.parameters()), "name": "all", "lr": 0.5}])
    assert [g["name"] for g in groups] == ["all", "ep_size_2"]
    assert groups[0]["params"] == dense and "moe" not in groups[0]
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.5 and len(groups[1]["params"]) == 2
    torch.optim.AdamW(groups)  # a valid optimizer layout: every param exactly once


def test_split_limits_expert_group_size() -> None:
    net = _Net()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"}, max_group_size=16)
    assert [len(g["params"]) for g in groups if g.get("moe")] == [1, 1]  # 16-element weight, then the bias


def test_configure_from_plain_params_and_errors() -> None:
    net = _Net()
    groups = configure_moe_param_groups(list(net.parameters()))
    assert [g["name"] for g in groups] == ["dense-params", "ep_size_2"]
    assert configure_moe_param_groups(groups) is groups  # already split: unchanged
    with pytest.raises(ValueError, match="has no 'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(net.parameters())}])
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        configure_moe_param_groups([1])
