"""Finding expert parameters and giving them their own optimizer param groups (DeepSpeed's `moe.utils`).

Expert parameters (marked by `Experts`: `allreduce=False`, `group_name`) must sit in optimizer
param groups of their own, flagged `moe: True` and named after their expert group, because ZeRO
partitions and reduces them over the expert-data-parallel group, not the data-parallel group.
`split_params_into_different_moe_groups_for_optimizer` turns ordinary groups into that layout:
each input group keeps its non-expert params and gains one copy of its hyper-parameters per
expert group name (params in at most `max_group_size` elements per group).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: elements per expert param group


def has_moe_layers(module: torch.nn.Module) -> tuple[bool, int]:
    """(whether `module` holds an MoE layer, the first one's num_experts)."""
    from zerospeed.moe.layer import MoE

    for child in module.modules():
        if isinstance(child, MoE):
            return True, child.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(
        params: list[torch.nn.Parameter]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: list[torch.nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients (cast to their param's dtype) of non-expert and of expert params, for norms."""
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    expert = [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]
    return shared, expert


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"Unknown param group type of {type(param_groups)}")


def _chunks(params: list[torch.nn.Parameter], max_group_size: float) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` of at most `max_group_size` elements (a bigger param alone)."""
    chunks: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for param in params:
        numel = getattr(param, "ds_numel", param.numel())
        if current and size + numel > max_group_size:
            chunks.append(current)
            current, size = [], 0
        current.append(param)
        size += numel
    if current:
        chunks.append(current)
    return chunks


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Any, max_group_size: float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """Move expert params out of `param_groups` into groups `{**group, name: <expert group>, moe: True}`.

    Every input group needs a `name` (the expert groups are keyed by it); the result lists the
    input groups first (expert params removed) and then the expert groups, in input order."""
    groups = _as_group_list(param_groups)
    for index, group in enumerate(groups):
        if "name" not in group:
            raise ValueError(f"param group {index} has no 'name'; MoE param group splitting needs a name per group")
    expert_group_names: list[str] = []
    for group in groups:
        for param in group["params"]:
            if is_moe_param(param) and param.group_name not in expert_group_names:
                expert_group_names.append(param.group_name)
    expert_groups: list[dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name in expert_group_names:
            members = [p for p in params if is_moe_param(p) and p.group_name == name]
            base = {**group, "name": name, "moe": True}
            chunks = _chunks(members, max_group_size) if max_group_size is not None else [members]
            expert_groups.extend({**base, "params": chunk} for chunk in chunks)
    return groups + expert_groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Params or param groups -> groups with the expert params split out (unless already split)."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for item in model_parameters:
        if not isinstance(item, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(item)}")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
