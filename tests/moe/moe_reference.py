"""An independent single-process float64 reference of the MoE layer, token by token.

It restates the routing rules (docs/moe.md, [Note: routes] in zerospeed/moe/routing.py) with
Python loops over tokens instead of masks and cumsums, runs each kept route's expert on that one
token, and supports the deterministic policies only (top-1 first-come, top-2 without sampling), so
the kept set is defined without random draws or topk ties.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Expert = Callable[[torch.Tensor], torch.Tensor]


def mlp_expert(params: dict[str, torch.Tensor]) -> Expert:
    """The test expert, Linear -> tanh -> Linear, from its state dict (keys 0.weight ... 2.bias)."""
    return lambda x: torch.tanh(x @ params["0.weight"].t() + params["0.bias"]) @ params["2.weight"].t() \
        + params["2.bias"]


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int,
             drop_tokens: bool) -> float:
    if not drop_tokens:
        return math.inf
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


def route(gates: torch.Tensor, k: int, cap: float) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """Per token the kept (expert, weight) pairs, and the per-expert counts before dropping."""
    num_tokens, num_experts = gates.shape
    choices = [[int(gates[s].argmax())] for s in range(num_tokens)]
    if k == 2:
        for s in range(num_tokens):
            rest = gates[s].clone()
            rest[choices[s][0]] = -math.inf
            choices[s].append(int(rest.argmax()))
    counts = [0] * num_experts
    kept: list[list[int]] = [[] for _ in range(num_tokens)]
    for rank_of_choice in range(k):          # all first choices queue before any second choice
        for s in range(num_tokens):
            expert = choices[s][rank_of_choice]
            if counts[expert] < cap:
                kept[s].append(expert)
            counts[expert] += 1
    routes = []
    for s in range(num_tokens):
        if k == 1:
            routes.append([(e, gates[s, e]) for e in kept[s]])
        else:
            total = sum(gates[s, e] for e in kept[s])
            routes.append([(e, gates[s, e] / total) for e in kept[s]])
    return routes, counts


def aux_loss(gates: torch.Tensor, k: int) -> torch.Tensor:
    num_tokens, num_experts = gates.shape
    top1 = torch.zeros_like(gates)
    top1[torch.arange(num_tokens), gates.argmax(dim=1)] = 1.0
    per_expert = gates.mean(dim=0) * top1.mean(dim=0)
    return per_expert.sum() * num_experts if k == 1 else per_expert.mean() * num_experts * num_experts


def moe_forward(x: torch.Tensor, gate_weight: torch.Tensor, experts: list[Expert], k: int, cap: float,
                residual: tuple[Expert, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """x [S, d] -> (output [S, d], l_aux, exp_counts); `residual` = (mlp, coefficient weight, bias)."""
    gates = torch.softmax(x @ gate_weight.t(), dim=1)
    routes, counts = route(gates.detach(), k, cap)
    rows = []
    for s, token_routes in enumerate(routes):
        row = torch.zeros_like(x[s])
        for expert, _ in token_routes:
            weight = gates[s, expert] if k == 1 else gates[s, expert] / sum(gates[s, e] for e, _ in token_routes)
            row = row + weight * experts[expert](x[s:s + 1])[0]
        rows.append(row)
    output = torch.stack(rows)
    if residual is not None:
        mlp, coef_weight, coef_bias = residual
        coef = torch.softmax(x @ coef_weight.t() + coef_bias, dim=-1)
        output = output * coef[:, 0:1] + mlp(x) * coef[:, 1:]
    return output, aux_loss(gates, k), counts


def leaf(tensor: Any) -> torch.Tensor:
    return torch.as_tensor(tensor).detach().double().requires_grad_(True)
