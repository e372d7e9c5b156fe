"""What `DeepSpeedEngine.__init__` does for Mixture-of-Experts layers (DeepSpeed's engine MoE steps).

1. Find the MoE layers and hand each its groups from the run's frozen groups (`set_expert_groups`;
   `engine_groups.build_run_groups` built the "ep_size_<n>" groups once per size, honouring
   `use_data_before_expert_parallelism`). Other modules with DeepSpeed's
   `set_deepspeed_parallelism` hook get it called, as DeepSpeed's engine does.
2. Broadcast expert parameters within their expert-data-parallel group (from its first rank), the
   other parameters as usual from data-parallel rank 0: the ranks of one expert-parallel group hold
   *different* experts, which a data-parallel broadcast would overwrite.
3. With a config optimizer, split the expert parameters into their own param groups
   (`moe.utils.configure_moe_param_groups`), as DeepSpeed's engine does.
Gradient reduction and the norm are in expert_gradients.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import RunGroups

__all__ = ["MoEInfo", "broadcast_expert_params", "moe_model_parameters", "setup_moe"]


@dataclasses.dataclass
class MoEInfo:
    num_experts: list[int] = dataclasses.field(default_factory=list)
    moe_layers: list[torch.nn.Module] = dataclasses.field(default_factory=list)
    gate_modules: list[torch.nn.Module] = dataclasses.field(default_factory=list)

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.num_experts)


def setup_moe(module: torch.nn.Module, run_groups: RunGroups | None = None,
              use_data_before_expert_parallel: bool = False) -> MoEInfo:
    """Find MoE layers and hand them their expert-parallel groups (step 1). Without `run_groups`
    (a layer tested alone) each ep size's groups are built here, once per size."""
    from zerospeed.comm import groups

    from zerospeed.moe.layer import MoE
    from zerospeed.moe.sharded_moe import MOELayer, TopKGate

    info = MoEInfo()
    for child in module.modules():
        if isinstance(child, MoE):
            info.num_experts.append(child.num_experts)
        elif isinstance(child, MOELayer):
            info.moe_layers.append(child)
        elif isinstance(child, TopKGate):
            info.gate_modules.append(child)
    for child in module.modules():
        if isinstance(child, MoE):
            child.set_expert_groups(run_groups.expert(child.expert_group_name) if run_groups is not None else
                                    groups.build_expert_groups(child.ep_size, 1, use_data_before_expert_parallel))
        elif hasattr(child, "set_deepspeed_parallelism"):
            child.set_deepspeed_parallelism(use_data_before_expert_parallel)  # type: ignore[operator]  # found by hasattr
    for layer_id, child in enumerate(c for c in module.modules() if isinstance(c, MoE)):
        child.deepspeed_moe.comm_log_name = f"moe_layer_{layer_id}"   # the checkpoint's layer numbering
    return info


@torch.no_grad()
def broadcast_expert_params(module: torch.nn.Module, run_groups: RunGroups) -> None:
    """Each expert parameter from the first rank of its expert-data-parallel group (step 2)."""
    from zerospeed.moe.experts import expert_group_name
    from zerospeed.moe.utils import is_moe_param

    for param in module.parameters():
        if is_moe_param(param) and not hasattr(param, "ds_id"):
            group = run_groups.expert(expert_group_name(param)).expert_data_parallel
            if group.size > 1:
                comm.broadcast(param.data, src=group.ranks[0], group=group.group)


def moe_model_parameters(model_parameters: Any) -> list[dict[str, Any]]:
    """The config optimizer's params with expert parameters in their own groups (step 3)."""
    from zerospeed.moe.utils import configure_moe_param_groups

    return configure_moe_param_groups(list(model_parameters))
