"""`EngineMoE`: Mixture-of-Experts as a component the engine holds (`engine.moe`).

Built once in `DeepSpeedEngine._init_module`, from the module and the run's frozen groups, and
always present: for a model without MoE layers it is inactive (no layers, nothing to broadcast,
the optimizer's parameters passed through), so the engine never branches on whether it exists.
DeepSpeed's engine attributes (`has_moe_layers`, `num_experts`, `moe_layers`, `gate_modules`) are
one-line delegates to it in engine_accessors.py. What it does, in DeepSpeed's engine order:

1. Construction: find the MoE layers and hand each its groups from the run's frozen groups
   (`set_expert_groups`; `engine_groups.build_run_groups` built the "ep_size_<n>" groups once per
   size of the layout, honouring `use_data_before_expert_parallelism`). Other modules with
   DeepSpeed's `set_deepspeed_parallelism` hook get it called, as DeepSpeed's engine does.
2. `broadcast_expert_params`: expert parameters from the first rank of their expert-data-parallel
   group (the engine broadcasts the other parameters from data-parallel rank 0): the ranks of one
   expert-parallel group hold *different* experts, which a data-parallel broadcast would overwrite.
3. `optimizer_parameters`: with a config optimizer, the expert parameters in their own param
   groups (`moe.utils.configure_moe_param_groups`), as DeepSpeed's engine does.
Gradient reduction and the norm are in expert_gradients.py.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import ExpertGroups, RunGroups

__all__ = ["EngineMoE"]


class EngineMoE:
    """The MoE layers of one engine's module and the expert groups each was handed."""

    def __init__(self, module: torch.nn.Module, run_groups: RunGroups | None = None,
                 use_data_before_expert_parallel: bool = False) -> None:
        """Find the layers and hand them their groups (step 1). Without `run_groups` (a layer
        driven without an engine) each ep size's groups are built here, once per size (collective)."""
        from zerospeed.moe.layer import MoE
        from zerospeed.moe.sharded_moe import MOELayer, TopKGate

        self.module = module
        self.num_experts: list[int] = [m.num_experts for m in module.modules() if isinstance(m, MoE)]
        self.moe_layers: list[torch.nn.Module] = [m for m in module.modules() if isinstance(m, MOELayer)]
        self.gate_modules: list[torch.nn.Module] = [m for m in module.modules() if isinstance(m, TopKGate)]
        self.expert_groups: dict[str, ExpertGroups] = {}
        for child in module.modules():
            if isinstance(child, MoE):
                child.set_expert_groups(self._groups_of(child, run_groups, use_data_before_expert_parallel))
            elif hasattr(child, "set_deepspeed_parallelism"):
                child.set_deepspeed_parallelism(use_data_before_expert_parallel)  # type: ignore[operator]  # found by hasattr
        for layer_id, child in enumerate(c for c in module.modules() if isinstance(c, MoE)):
            child.deepspeed_moe.comm_log_name = f"moe_layer_{layer_id}"   # the checkpoint's layer numbering

    def _groups_of(self, layer: Any, run_groups: RunGroups | None, data_first: bool) -> ExpertGroups:
        from zerospeed.comm import groups

        name = layer.expert_group_name
        if name not in self.expert_groups:
            self.expert_groups[name] = (run_groups.expert(name) if run_groups is not None
                                        else groups.build_expert_groups(layer.ep_size, 1, data_first))
        return self.expert_groups[name]

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.num_experts)

    @torch.no_grad()
    def broadcast_expert_params(self) -> None:
        """Each expert parameter from the first rank of its expert-data-parallel group (step 2);
        ZeRO-3 partitioned parameters (with a `ds_id`) were placed at construction."""
        from zerospeed.moe.experts import expert_group_name
        from zerospeed.moe.utils import is_moe_param

        if not self.has_moe_layers:
            return
        for param in self.module.parameters():
            if is_moe_param(param) and not hasattr(param, "ds_id"):
                group = self.expert_groups[expert_group_name(param)].expert_data_parallel
                if group.size > 1:
                    comm.broadcast(param.data, src=group.ranks[0], group=group.group)

    def optimizer_parameters(self, model_parameters: Any, client_optimizer: Any) -> Any:
        """What the config optimizer is built over (step 3): with MoE layers and no client optimizer
        the parameters (the module's when None are given) with expert parameters in their own
        groups; otherwise `model_parameters` unchanged (a client optimizer brings its own groups)."""
        from zerospeed.moe.utils import configure_moe_param_groups

        if not self.has_moe_layers or client_optimizer is not None:
            return model_parameters
        given = model_parameters if model_parameters is not None else self.module.parameters()
        return configure_moe_param_groups(list(given))
