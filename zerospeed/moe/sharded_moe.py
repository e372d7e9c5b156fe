"""DeepSpeed's `deepspeed.moe.sharded_moe` surface: the gating functions, `TopKGate` and `MOELayer`.

The routing arithmetic lives in routing.py ([Note: routes]) and the token movement in dispatch.py
([Note: MoE dispatch]); this module holds the two modules DeepSpeed users and its engine touch and
the gating functions with DeepSpeed's signatures and return values:
* `top1gating / top2gating / topkgating(logits, ...)` return `(l_aux, combine_weights [S, E, C],
  dispatch_mask [S, E, C], exp_counts)`, or with `sparse_routes=True` DeepSpeed 0.19.8's sparse tuple
  `(l_aux, capacity, num_experts, indices [k, S] int32, locations [k, S] int32, gates [k, S], exp_counts)`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerospeed.moe import dispatch
from zerospeed.moe.dropless import dropless_forward
from zerospeed.moe.experts import Experts
from zerospeed.moe.routing import (
    Routes,
    gumbel_rsample,
    multiplicative_jitter,
    top1_routes,
    top2_routes,
    topk_routes,
)
from zerospeed.utils.logging import logger

__all__ = ["MOELayer", "TopKGate", "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating",
           "topkgating"]

TUTEL_INSTALLED = False  # zerospeed has no Tutel path; use_tutel=True warns and runs the plain dispatch


def _gating_output(routes: Routes, sparse_routes: bool) -> tuple[Any, ...]:
    if sparse_routes:
        return (routes.l_aux, routes.capacity, routes.num_experts, routes.expert_index.to(torch.int32),
                routes.slot.to(torch.int32), routes.weight, routes.exp_counts)
    combine_weights, dispatch_mask = routes.dense()
    return routes.l_aux, combine_weights, dispatch_mask, routes.exp_counts


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False,
               drop_policy: str | None = None) -> tuple[Any, ...]:
    """Top-1 gating (Switch): see routing.top1_routes."""
    routes = top1_routes(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens,
                         use_rts, ep_group, drop_policy)
    return _gating_output(routes, sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False,
               drop_policy: str | None = None) -> tuple[Any, ...]:
    """Top-2 gating (GShard): see routing.top2_routes."""
    routes = top2_routes(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling,
                         drop_policy)
    return _gating_output(routes, sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple[Any, ...]:
    """Top-k gating for any k: see routing.topk_routes."""
    routes = topk_routes(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
    return _gating_output(routes, sparse_routes)


class TopKGate(torch.nn.Module):
    """The router: `wg` (d -> E, no bias) in fp32, then top-1, top-2 or top-k gating.

    `capacity_factor` applies in training, `eval_capacity_factor` in eval; the noise policy
    ('Jitter': input times U(0.99, 1.01); 'RSample': Gumbel noise on the top-1 choice) only in
    training. `drop_policy` is zerospeed's: None keeps DeepSpeed's choice of dropped tokens, see
    [Note: routes].
    """

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True, drop_policy: str | None = None) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.drop_policy = drop_policy
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None:
            raise RuntimeError("TopKGate: the expert-parallel group is already set")
        self.ep_group = ep_group

    def logits(self, input: Tensor) -> Tensor:
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = multiplicative_jitter(input_fp32, device=input.device)
        return torch.nn.functional.linear(input_fp32, weight=self.wg.weight.float(), bias=None)

    def route(self, input: Tensor, used_token: Tensor | None = None, group_capacity: bool = True) -> Routes:
        """[S, d] tokens -> `Routes` (fp32 throughout). `group_capacity=False` skips the all-reduce that
        pads a `drop_tokens=False` capacity to the expert-parallel group's largest count (the layer's
        dropless path has no capacity: [Note: dropless dispatch])."""
        logits = self.logits(input)
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        ep_group = self.ep_group if group_capacity or self.drop_tokens else None
        if self.k == 1:
            return top1_routes(logits, capacity_factor, self.min_capacity, used_token,
                               self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                               ep_group, self.drop_policy)
        if self.k == 2:
            return top2_routes(logits, capacity_factor, self.min_capacity, self.drop_tokens, ep_group,
                               self.top2_2nd_expert_sampling, self.drop_policy)
        return topk_routes(logits, self.k, capacity_factor, self.min_capacity, self.drop_tokens, ep_group,
                           self.drop_policy or "probs")

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> tuple[Any, ...]:
        return _gating_output(self.route(input, used_token), sparse_routes)


class MOELayer(torch.nn.Module):
    """Gate, dispatch, all-to-all, experts, all-to-all, combine ([Note: MoE dispatch]).

    `forward(tokens[..., d], used_token=None)` returns the combined output in the input's shape and
    leaves `l_aux` and `exp_counts` on the module, as DeepSpeed's does. With the gate's
    `drop_tokens=False` the tokens travel unpadded instead ([Note: dropless dispatch]).
    """

    def __init__(self, gate: TopKGate, experts: torch.nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        if use_tutel:
            logger.warning("Tutel optimization requested but zerospeed has no Tutel path; "
                           "proceeding with the standard dispatch.")
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        # Comms-logger name of this layer's all-to-alls ("moe_layer_<l>", set by the engine in
        # checkpoint layer order); None logs them as plain all_to_all_single.
        self.comm_log_name: str | None = None

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        dropless = not self.gate.drop_tokens
        routes = self.gate.route(tokens, input[1] if len(input) > 1 else None, group_capacity=not dropless)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        if dropless:  # no capacity, no padding: [Note: dropless dispatch]
            self._check_group()
            if not isinstance(self.experts, Experts):
                raise TypeError("MOELayer with drop_tokens=False runs each expert on its own rows and needs "
                                f"zerospeed.moe.experts.Experts, got {type(self.experts).__name__}")
            output = dropless_forward(tokens, routes.expert_index, routes.weight, self.experts, self.ep_size,
                                      self.ep_group, self.comm_log_name)
            return output.reshape(hidden.shape)
        num_experts, capacity = routes.num_experts, int(routes.capacity)
        slots = dispatch.flat_slots(routes.expert_index, routes.slot, num_experts, capacity)
        expert_input = dispatch.encode(tokens, slots, num_experts, capacity)
        expert_input = self._exchange(expert_input, "dispatch")
        expert_output = self.experts(expert_input.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        expert_output = self._exchange(expert_output.reshape(num_experts, -1, d_model), "combine")
        return dispatch.decode(expert_output, slots, routes.weight).reshape(hidden.shape)

    def _check_group(self) -> None:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: call "
                               "set_deepspeed_parallelism() before forward (deepspeed.initialize hands the layer its groups)")

    def _exchange(self, buffers: Tensor, step: str) -> Tensor:
        if self.ep_size > 1:
            self._check_group()
            name = None if self.comm_log_name is None else f"{self.comm_log_name}.{step}"
            return dispatch.all_to_all(self.ep_group, buffers, name)
        return buffers.contiguous()
