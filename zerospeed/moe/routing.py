"""Token routing for Mixture-of-Experts gates: DeepSpeed 0.19.8's top-1, top-2 and top-k formulas.

[Note: routes]
A gate turns fp32 logits [S, E] (S tokens, E experts) into `Routes`: for each of the k choices of
every token, the expert it goes to (-1 when the capacity limit dropped it), its slot in that
expert's buffer of `capacity` slots, and the weight its expert output gets when combined. The
layer moves tokens with these index tensors (dispatch.py), never with the dense [S, E, C] one-hot
tensors GShard describes; `Routes.dense()` builds those for callers of DeepSpeed's
`top1gating(...)`-style functions, which return them.

The arithmetic follows DeepSpeed 0.19.8 exactly, so the same logits give the same routes, weights
and auxiliary loss bit for bit (tests/compat/test_moe_compat.py):
* capacity = max(ceil(S / E * factor), min_capacity), computed in float32 as DeepSpeed does (so a
  product that lands just above an integer in float32 rounds up there too); factor is
  `capacity_factor` for k = 1, 2x it for k = 2, k x it for k > 2;
* `exp_counts` counts each expert's routes *before* dropping;
* l_aux: k = 1: sum_e(mean_s gates * mean_s top1-mask) * E; k = 2: mean_e(...) * E * E with the
  top-1 mask; k > 2: mean_e(gates-mean * top-k-mask-mean) * E * E / k;
* weights: k = 1 keeps the raw softmax probability; k >= 2 renormalises over the kept routes
  (divided by max(sum, float32 eps)), so a token whose second route was dropped keeps weight 1;
* `drop_tokens=False` sizes the buffers to the largest per-expert count, all-reduced (MAX) over the
  expert-parallel group so every rank's all-to-all has the same shape.
Which tokens survive the capacity limit (`drop_policy`):
* None (DeepSpeed): k = 1 keeps a random subset when `use_rts` (uniform noise on the mask, then
  top-capacity), else whatever `torch.topk` returns over a 0/1 mask (ties: unspecified order);
  k = 2 keeps the first-come by token position, top-1 choices before second choices; k > 2 keeps
  the routes with the highest gate values ("probs");
* "position": first-come by token position for every k (deterministic; zerospeed's option for k = 1);
* "probs": highest gate value first (k = 1 and k > 2).
Random draws use torch.distributions in DeepSpeed's order, so a seeded run draws the same noise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from zerospeed import comm

__all__ = ["Routes", "capacity_for", "gumbel_rsample", "multiplicative_jitter", "top1_routes", "top2_routes",
           "topk_routes"]

DROP_POLICIES = (None, "position", "probs")


@dataclasses.dataclass
class Routes:
    """Where each of a token's k routes goes; see [Note: routes]. Index tensors are [k, S]."""

    l_aux: torch.Tensor
    capacity: torch.Tensor          # 0-dim int64: slots per expert
    num_experts: int
    expert_index: torch.Tensor      # [k, S] int64, -1 = dropped
    slot: torch.Tensor              # [k, S] int64, 0 where dropped
    weight: torch.Tensor            # [k, S] fp32, 0 where dropped; carries the gate's gradient
    exp_counts: torch.Tensor        # [E] routes per expert before dropping

    @property
    def k(self) -> int:
        return self.expert_index.shape[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine_weights [S, E, C] fp32, dispatch_mask [S, E, C] bool), GShard's dense form."""
        num_tokens = self.expert_index.shape[1]
        capacity = int(self.capacity)
        combine = self.weight.new_zeros(num_tokens, self.num_experts * capacity)
        kept = self.expert_index >= 0
        flat = torch.where(kept, self.expert_index * capacity + self.slot, 0)
        for route in range(self.k):
            # Route r of a token never shares its expert with another route of that token, so adding is exact.
            contribution = torch.zeros_like(combine).scatter(1, flat[route:route + 1].t(),
                                                             (self.weight[route] * kept[route]).unsqueeze(1))
            combine = combine + contribution
        combine = combine.view(num_tokens, self.num_experts, capacity)
        return combine, combine.bool()


# --- noise (DeepSpeed's distributions, so seeded runs draw the same numbers) ------------------

def multiplicative_jitter(x: torch.Tensor, device: torch.device, epsilon: float = 1e-2) -> torch.Tensor:
    """x times U(1 - epsilon, 1 + epsilon) noise (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * torch.distributions.uniform.Uniform(low, high).rsample(x.shape)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> torch.Tensor:
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform01(shape: torch.Size, device: torch.device) -> torch.Tensor:
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.uniform.Uniform(zero, one).rsample(shape)


# --- capacity ---------------------------------------------------------------------------------

def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> torch.Tensor:
    """max(ceil(S / E * factor), min_capacity) as a 0-dim int64 tensor, the product in float32."""
    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return torch.maximum(capacity, torch.tensor(min_capacity).to(torch.int64))


def dropless_capacity(exp_counts: torch.Tensor, ep_group: Any, tp_size: int = 1) -> torch.Tensor:
    """The largest per-expert count over the expert-parallel group, padded to a multiple of `tp_size`."""
    capacity = exp_counts.max()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(capacity, op=comm.ReduceOp.MAX, group=ep_group)
    if tp_size > 1:
        capacity = torch.ceil(capacity / tp_size).mul(tp_size).to(capacity.dtype)
    return capacity


def _check_policy(drop_policy: str | None, allowed: tuple[str | None, ...], k: int) -> None:
    if drop_policy not in allowed:
        raise ValueError(f"drop_policy={drop_policy!r} is not supported for k={k}; use one of {allowed}")


# --- top-1 ------------------------------------------------------------------------------------

def top1_routes(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
                used_token: torch.Tensor | None = None, noisy_gate_policy: str | None = None,
                drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                drop_policy: str | None = None, tp_size: int = 1) -> Routes:
    _check_policy(drop_policy, DROP_POLICIES, 1)
    noisy_logits = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    expert = torch.argmax(noisy_logits if noisy_logits is not None else gates, dim=1)
    mask = F.one_hot(expert, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = torch.minimum(dropless_capacity(exp_counts, ep_group, tp_size), torch.tensor(num_tokens))
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if num_tokens < min_capacity:
        raise ValueError(f"the MoE layer got {num_tokens} tokens, fewer than min_capacity={min_capacity}; "
                         "set min_capacity lower or feed more tokens")
    mask = _top1_keep(mask, gates, capacity, use_rts, drop_policy)
    slots = torch.cumsum(mask, dim=0) - 1
    kept = mask.sum(dim=1) > 0
    return Routes(l_aux=l_aux, capacity=capacity, num_experts=num_experts,
                  expert_index=torch.where(kept, expert, -1).unsqueeze(0),
                  slot=(slots * mask).sum(dim=1).unsqueeze(0),
                  weight=(gates * mask).sum(dim=1).unsqueeze(0), exp_counts=exp_counts)


def _top1_keep(mask: torch.Tensor, gates: torch.Tensor, capacity: torch.Tensor, use_rts: bool,
               drop_policy: str | None) -> torch.Tensor:
    """The routes that fit in each expert's capacity (see the policies in [Note: routes])."""
    if drop_policy == "position":
        return mask * torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
    if drop_policy == "probs":
        scores = gates.detach() * mask
    elif use_rts:
        scores = mask * _uniform01(mask.shape, mask.device)
    else:
        scores = mask
    # topk over the token dimension cannot select more rows than there are tokens.
    selected = torch.topk(scores, k=int(min(int(capacity), mask.shape[0])), dim=0)[1]
    return mask * torch.zeros_like(mask).scatter_(0, selected, 1)


# --- top-2 ------------------------------------------------------------------------------------

def top2_routes(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
                ep_group: Any = None, top2_2nd_expert_sampling: bool = True, drop_policy: str | None = None,
                tp_size: int = 1) -> Routes:
    _check_policy(drop_policy, (None, "position"), 2)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:  # Gumbel-max: sample the second expert in proportion to its probability
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    slots1 = torch.cumsum(mask1, dim=0) - 1
    # Second choices queue behind every first choice of the same expert.
    slots2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(slots1, capacity)
        mask2 = mask2 * torch.lt(slots2, capacity)
    else:
        capacity = dropless_capacity(exp_counts, ep_group, tp_size)
    weight1 = (gates * mask1.float()).sum(dim=1)
    weight2 = (gates * mask2.float()).sum(dim=1)
    total = torch.clamp(weight1 + weight2, min=torch.finfo(weight1.dtype).eps)
    return Routes(l_aux=l_aux, capacity=capacity, num_experts=num_experts,
                  expert_index=torch.stack([torch.where(mask1.any(dim=1), first, -1),
                                            torch.where(mask2.any(dim=1), second, -1)]),
                  slot=torch.stack([(slots1 * mask1).sum(dim=1), (slots2 * mask2).sum(dim=1)]),
                  weight=torch.stack([weight1 / total, weight2 / total]), exp_counts=exp_counts)


# --- top-k, k > 2 -----------------------------------------------------------------------------

def topk_routes(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
                drop_tokens: bool = True, ep_group: Any = None, drop_policy: str | None = "probs",
                tp_size: int = 1) -> Routes:
    _check_policy(drop_policy, DROP_POLICIES, k)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if not 0 < k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
    top_gate, top_expert = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_expert, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        mask = _topk_keep(mask, gates, top_gate, top_expert, capacity, drop_policy or "probs")
    else:
        capacity = dropless_capacity(exp_counts, ep_group, tp_size)
    slots = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    weights = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_expert)
    # Route r of token s is its r-th largest gate; DeepSpeed lays routes out as [k, S].
    return Routes(l_aux=l_aux, capacity=capacity, num_experts=num_experts,
                  expert_index=torch.where(kept, top_expert, -1).t().contiguous(),
                  slot=(slots.gather(1, top_expert) * kept).t().contiguous(),
                  weight=weights.gather(1, top_expert).t().contiguous(), exp_counts=exp_counts)


def _topk_keep(mask: torch.Tensor, gates: torch.Tensor, top_gate: torch.Tensor, top_expert: torch.Tensor,
               capacity: torch.Tensor, drop_policy: str) -> torch.Tensor:
    if drop_policy == "position":
        return mask * torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
    scores = torch.zeros_like(gates).scatter(1, top_expert, top_gate)
    selection = int(min(int(capacity), gates.shape[0]))
    chosen = torch.topk(scores, k=selection, dim=0, sorted=False)[1]
    return mask & torch.zeros_like(gates, dtype=torch.bool).scatter_(0, chosen, True)
