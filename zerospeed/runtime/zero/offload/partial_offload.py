"""`offload_optimizer.ratio < 1` at stage 3 (DeepSpeed's partial offload, "Twin-Flow"): the
optimizer for the sub-groups that stay on the accelerator, and the checkpoint layout across both.

[Note: partial offload]
With N sub-groups on a rank, the first `num_sub_groups_on_device(N, ratio)` (sub_groups.py) keep
their fp32 master, gradient and optimizer state on the accelerator, exactly as without offload;
the rest are registered with `OffloadStates`, in order, so offloaded sub-group k is its partition
`k - num_on_device`. One gradient norm, one clip multiplier and one overflow check cover both.

- The device sub-groups are stepped by the torch counterpart of the CPU optimizer (DeepSpeed's
  `backup_optimizer`): `torch.optim.AdamW` for `DeepSpeedCPUAdam` in adamw mode, `torch.optim.Adam`
  otherwise. Its param groups mirror the CPU optimizer's and copy their hyperparameters before
  every step, so an lr scheduler driving the CPU optimizer drives both. DeepSpeed accepts only
  `DeepSpeedCPUAdam` here; so does zerospeed (Adagrad and Lion have no torch twin with the same
  state, which the checkpoint layout needs), and `bias_correction: false` has no torch twin either.
- Checkpoints keep the layout without offload: one optimizer param per sub-group, numbered in
  sub-group order, each entry in the CPU optimizer's form (an int `step`), so a checkpoint moves
  between ratios, full offload and no offload, and zero_to_fp32 reads it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.ops.adam import DeepSpeedCPUAdam

__all__ = ["build_device_optimizer", "load_device_state", "merge_state_dicts", "split_state_dict"]

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
_KEY = "zero_optimization.offload_optimizer.ratio"


def _device_class(cpu_optimizer: torch.optim.Optimizer) -> type[torch.optim.Adam] | type[torch.optim.AdamW]:
    if not isinstance(cpu_optimizer, DeepSpeedCPUAdam):
        raise ValueError(f"{_KEY} < 1 needs DeepSpeedCPUAdam (optimizer type Adam or AdamW), as in DeepSpeed: the "
                         "sub-groups kept on the accelerator are stepped by its torch counterpart; got "
                         f"{type(cpu_optimizer).__name__}")
    if not all(group["bias_correction"] for group in cpu_optimizer.param_groups):
        raise ValueError(f"{_KEY} < 1 needs bias_correction: the sub-groups kept on the accelerator are stepped by "
                         "torch's Adam, which always corrects bias")
    return torch.optim.AdamW if cpu_optimizer.adam_w_mode else torch.optim.Adam


def _follow(device_optimizer: torch.optim.Optimizer, cpu_optimizer: torch.optim.Optimizer) -> None:
    for mine, theirs in zip(device_optimizer.param_groups, cpu_optimizer.param_groups):
        mine.update({key: theirs[key] for key in _HYPERPARAMETERS})


def build_device_optimizer(cpu_optimizer: torch.optim.Optimizer,
                           masters_per_group: list[list[torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """The torch counterpart of `cpu_optimizer` over the device masters, one param group per CPU
    param group (possibly empty), following its hyperparameters at every step."""
    device_class = _device_class(cpu_optimizer)
    groups = [{"params": masters, **{key: group[key] for key in _HYPERPARAMETERS}}
              for masters, group in zip(masters_per_group, cpu_optimizer.param_groups)]
    device_optimizer = device_class(groups)
    device_optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: _follow(optimizer, cpu_optimizer))
    return device_optimizer


# --- checkpoints: the layout without offload ----------------------------------------------------------
def _entry(state: dict[str, Any]) -> dict[str, Any]:
    """A torch Adam state in the CPU optimizer's form (its 0-dim tensor `step` as an int)."""
    return {key: int(value) if key == "step" else value for key, value in state.items()}


def merge_state_dicts(device_optimizer: torch.optim.Optimizer, device_masters: list[torch.nn.Parameter],
                      offloaded: dict[str, Any], group_ranges: list[range]) -> dict[str, Any]:
    """One optimizer state_dict: sub-group k < len(device_masters) from `device_optimizer`, the rest
    from `offloaded` (OffloadStates', numbered by partition); `group_ranges[g]`: group g's sub-groups."""
    num_on_device = len(device_masters)
    state = {k: _entry(device_optimizer.state[m]) for k, m in enumerate(device_masters) if device_optimizer.state.get(m)}
    state.update({num_on_device + int(p): entry for p, entry in offloaded["state"].items()})
    groups = [{**{key: value for key, value in group.items() if key != "params"}, "params": list(sub_groups)}
              for group, sub_groups in zip(offloaded["param_groups"], group_ranges)]
    return {"state": state, "param_groups": groups}


def split_state_dict(saved: dict[str, Any], num_on_device: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """(entries of the device sub-groups by index, the rest as OffloadStates' state_dict)."""
    state = {int(key): value for key, value in saved["state"].items()}
    device = {k: state.get(k, {}) for k in range(num_on_device)}
    offloaded = {
        "state": {k - num_on_device: entry for k, entry in state.items() if k >= num_on_device},
        "param_groups": [{**group, "params": [k - num_on_device for k in group["params"] if k >= num_on_device]}
                         for group in saved["param_groups"]],
    }
    return device, offloaded


@torch.no_grad()
def load_device_state(device_optimizer: torch.optim.Optimizer, device_masters: list[torch.nn.Parameter],
                      entries: dict[int, dict[str, Any]]) -> None:
    """Set each device master's state from its saved entry (an empty entry: not stepped yet)."""
    for index, master in enumerate(device_masters):
        state: dict[str, Any] = {}
        for key, value in entries.get(index, {}).items():
            if key == "step":     # torch keeps it as a 0-dim fp32 CPU tensor (no capturable / fused here)
                state[key] = torch.tensor(float(value), dtype=torch.float32)
            elif torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.to(master.device, torch.float32).reshape(master.shape).clone()
            else:
                state[key] = value
        device_optimizer.state.pop(master, None)
        if state:
            device_optimizer.state[master] = state
