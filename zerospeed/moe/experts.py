"""`Experts`: this rank's copies of the expert module, each marked as an expert parameter.

Every expert parameter gets DeepSpeed's two attributes, which the engine and ZeRO read to reduce
its gradient over the expert-data-parallel group instead of the whole data-parallel group:
`allreduce = False` and `group_name` (e.g. "ep_size_2"). `moe.utils.is_moe_param` tests them.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["Experts", "expert_group_name", "mark_expert_param"]


# DeepSpeed's markers on an expert parameter (clients read them): not replicated over data-parallel
# ranks, and the name of its expert group; ours: how many experts this rank holds (checkpoint reshards).
ALLREDUCE_ATTR, GROUP_NAME_ATTR, NUM_LOCAL_EXPERTS_ATTR = "allreduce", "group_name", "zs_num_local_experts"


def mark_expert_param(param: torch.Tensor, group_name: str, num_local_experts: int) -> None:
    setattr(param, ALLREDUCE_ATTR, False)
    setattr(param, GROUP_NAME_ATTR, group_name)
    setattr(param, NUM_LOCAL_EXPERTS_ATTR, num_local_experts)


def expert_group_name(param: torch.Tensor) -> str:
    """The expert group an expert parameter belongs to (its `group_name`)."""
    return str(getattr(param, GROUP_NAME_ATTR))


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
                mark_expert_param(param, str(expert_group_name), num_local_experts)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """[ep_size, num_local_experts, C, d] -> the same shape, expert i applied to [:, i]."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: keep output
        return torch.cat(outputs, dim=1)
