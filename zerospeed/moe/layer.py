"""`MoE`: DeepSpeed's Mixture-of-Experts layer (`deepspeed.moe.layer.MoE`), same signature and returns.

`MoE(hidden_size, expert, num_experts, ep_size, k, ...)(hidden_states)` returns
`(output, l_aux, exp_counts)`; the caller adds `l_aux` (times a coefficient) to its loss. The
`num_experts` experts are spread over `ep_size` ranks (`num_experts / ep_size` local copies of
`expert` on each). The engine hands each layer its process groups from the run's frozen groups
(`set_expert_groups`, [Note: run groups] in comm/run_groups.py); DeepSpeed's
`set_deepspeed_parallelism()` stays for user code driving a layer without an engine (it builds or
finds the groups through `zerospeed.utils.groups`). With `use_residual` (Residual MoE, arXiv 2201.05596) `expert` also
runs densely as `mlp` and a learned 2-way softmax mixes the two outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zerospeed.comm.run_groups import ExpertGroups
from zerospeed.moe.experts import Experts
from zerospeed.moe.sharded_moe import MOELayer, TopKGate
from zerospeed.utils.logging import log_dist

__all__ = ["MoE"]

_NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class MoE(torch.nn.Module):
    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = True,
                 drop_policy: str | None = None) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size != 0:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if noisy_gate_policy not in _NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: unsupported noisy_gate_policy {noisy_gate_policy!r}; "
                             "use None, 'Jitter' or 'RSample'")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log_dist(f"Creating MoE layer with num_experts: {num_experts} | num_local_experts: "
                 f"{self.num_local_experts} | expert_parallel_size: {ep_size}", [0])
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling, drop_policy)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def set_expert_groups(self, expert_groups: ExpertGroups) -> None:
        """Take this layer's groups from the run's (the engine calls it): no lookup by name."""
        if expert_groups.name != self.expert_group_name:
            raise ValueError(f"MoE layer with ep_size {self.ep_size} was handed the groups of {expert_groups.name}")
        self.deepspeed_moe._set_ep_group(expert_groups.expert_parallel.group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create this layer's expert-parallel groups once per ep size, then hand the layer its group."""
        from zerospeed.utils import groups

        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, Any, Any]:
        """Returns (output like hidden_states, l_aux (0-dim fp32), exp_counts [num_experts])."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
