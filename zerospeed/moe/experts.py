"""`Experts`: this rank's copies of the expert module, each marked as an expert parameter.

Every expert parameter gets DeepSpeed's two attributes, which the engine and ZeRO read to reduce
its gradient over the expert-data-parallel group instead of the whole data-parallel group:
`allreduce = False` and `group_name` (e.g. "ep_size_2"). `moe.utils.is_moe_param` tests them.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["Experts"]


class Experts(torch.nn.Module):
    """`num_local_experts` deep copies of `expert`; `forward` runs copy i on input[:, i] chunks."""

    deepspeed_experts: torch.nn.ModuleList
    num_local_experts: int

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local_expert in self.deepspeed_experts:
            for param in local_expert.parameters():
                param.allreduce = False
                param.group_name = expert_group_name
                param.zs_num_local_experts = num_local_experts   # ours: global ids on a checkpoint reshard

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """[ep_size, num_local_experts, C, d] -> the same shape, expert i applied to [:, i]."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: keep output
        return torch.cat(outputs, dim=1)
