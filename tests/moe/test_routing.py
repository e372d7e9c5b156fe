"""Routing rules checked on hand-built logits (independent of DeepSpeed; tests/compat compares with it)."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.moe.layer import MoE
from zerospeed.moe.routing import capacity_for, top1_routes, top2_routes, topk_routes


def _logits_choosing(first: list[int], second: list[int] | None = None, num_experts: int = 4) -> torch.Tensor:
    """Logits whose softmax puts each token's largest gate on `first[s]`, the next on `second[s]`."""
    logits = torch.zeros(len(first), num_experts)
    for s, expert in enumerate(first):
        logits[s, expert] = 3.0 + 0.1 * s
        if second is not None:
            logits[s, second[s]] = 1.0
    return logits


def test_capacity_is_computed_in_float32_like_deepspeed() -> None:
    # 25 / 2 * 1.2 = 15 exactly, but 1.2 in float32 is 1.20000005: DeepSpeed's capacity is 16.
    assert int(capacity_for(25, 2, 1.2, 0)) == 16
    assert int(capacity_for(16, 4, 0.5, 0)) == 2
    assert int(capacity_for(16, 4, 0.5, 5)) == 5  # min_capacity is a floor


def test_top1_position_policy_keeps_first_come_tokens() -> None:
    logits = _logits_choosing([0, 0, 1, 0, 0, 2, 0, 0])
    routes = top1_routes(logits, capacity_factor=1.0, min_capacity=2, drop_policy="position")
    assert int(routes.capacity) == 2
    assert routes.expert_index[0].tolist() == [0, 0, 1, -1, -1, 2, -1, -1]
    assert routes.slot[0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert routes.exp_counts.tolist() == [6, 1, 1, 0]  # counted before dropping
    gates = torch.softmax(logits, dim=1)
    kept = routes.expert_index[0] >= 0
    expected = gates[torch.arange(8), logits.argmax(dim=1)] * kept  # top-1 keeps the raw probability
    assert torch.equal(routes.weight[0], expected)


def test_top2_second_choices_queue_behind_first_choices_and_weights_renormalise() -> None:
    logits = _logits_choosing(first=[0, 0, 1, 1], second=[1, 1, 0, 0])
    routes = top2_routes(logits, capacity_factor=0.5, min_capacity=2, top2_2nd_expert_sampling=False)
    assert int(routes.capacity) == 2  # ceil(4 / 4 * 0.5 * 2) = 1, raised to min_capacity 2
    # Expert 0: first choices of tokens 0, 1 take both slots; the second choices of 2, 3 are dropped.
    assert routes.expert_index.tolist() == [[0, 0, 1, 1], [-1, -1, -1, -1]]
    assert torch.allclose(routes.weight[0], torch.ones(4))  # a lone surviving route gets weight 1
    relaxed = top2_routes(logits, capacity_factor=1.0, min_capacity=4, top2_2nd_expert_sampling=False)
    assert relaxed.slot.tolist() == [[0, 1, 0, 1], [2, 3, 2, 3]]
    gates = torch.softmax(logits, dim=1)
    pair = torch.stack([gates[torch.arange(4), relaxed.expert_index[0]], gates[torch.arange(4), relaxed.expert_index[1]]])
    torch.testing.assert_close(relaxed.weight, pair / pair.sum(dim=0))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_aux_loss_formulas(k: int) -> None:
    logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(k))
    gates = torch.softmax(logits, dim=1)
    top1 = torch.nn.functional.one_hot(gates.argmax(dim=1), 6).float()
    if k == 1:
        routes, expected = top1_routes(logits, 1.0, 1, use_rts=False), (gates.mean(0) * top1.mean(0)).sum() * 6
    elif k == 2:
        routes = top2_routes(logits, 1.0, 1, top2_2nd_expert_sampling=False)
        expected = (gates.mean(0) * top1.mean(0)).mean() * 36
    else:
        mask = torch.zeros_like(gates).scatter(1, gates.topk(3, dim=1).indices, 1.0)
        routes, expected = topk_routes(logits, 3, 1.0, 1), (gates.mean(0) * mask.mean(0)).mean() * 36 / 3
    torch.testing.assert_close(routes.l_aux, expected)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_capacity_is_the_largest_count(k: int) -> None:
    logits = _logits_choosing([0] * 10 + [1, 2], num_experts=4) + 0.01 * torch.randn(12, 4)
    route = {1: lambda: top1_routes(logits, 1.0, 1, drop_tokens=False),
             2: lambda: top2_routes(logits, 1.0, 1, drop_tokens=False, top2_2nd_expert_sampling=False),
             3: lambda: topk_routes(logits, 3, 1.0, 1, drop_tokens=False)}[k]
    routes = route()
    assert int(routes.capacity) == int(routes.exp_counts.max())
    assert bool((routes.expert_index >= 0).all())
    torch.testing.assert_close(routes.weight.sum(dim=0), torch.ones(12) if k > 1 else routes.weight[0])


def test_dense_form_matches_the_routes() -> None:
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    routes = top2_routes(logits, 0.5, 1, top2_2nd_expert_sampling=False)
    combine, dispatch = routes.dense()
    assert combine.shape == (10, 4, int(routes.capacity)) and dispatch.dtype == torch.bool
    for s in range(10):
        for r in range(2):
            e, c = int(routes.expert_index[r, s]), int(routes.slot[r, s])
            if e >= 0:
                assert combine[s, e, c] == routes.weight[r, s]
    assert int(dispatch.sum()) == int((routes.expert_index >= 0).sum())


def test_bad_input_gets_clear_errors() -> None:
    logits = torch.randn(8, 4)
    with pytest.raises(ValueError, match="min_capacity"):
        top1_routes(logits, 1.0, min_capacity=9)
    with pytest.raises(ValueError, match="drop_policy"):
        top2_routes(logits, 1.0, 1, drop_policy="probs")
    with pytest.raises(ValueError, match="k=5"):
        topk_routes(logits, 5, 1.0, 1)
    expert = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="divisible by ep_size"):
        MoE(4, expert, num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(4, expert, num_experts=2, noisy_gate_policy="Gaussian")
    assert math.isfinite(float(top1_routes(logits, 1.0, 1).l_aux))
