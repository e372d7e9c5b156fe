"""What every wrapper's import of a full state shares: the state dict its `load_state_dict` expects, cut from the full representation.

[Note: full layout] (full_state.py) holds every parameter's fp32 master, moments and scalars by
name. Each wrapper's `load_full_state` (its side of [Note: checkpoint contract] in contract.py)
cuts its own rank's part of it in its own layout, beside the rest of its checkpoint half
(data_parallel.py, zero/stage_1_and_2_checkpoint.py, zero/stage3_checkpoint.py); here are the
pieces they share, which know no wrapper.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.full_state import FullOptimizerState

__all__ = ["ParamNames", "cloned", "copy_into_params", "flat_offsets", "require", "with_hyperparams",
           "with_loss_scaler"]

ParamNames = dict[torch.nn.Parameter, str]


def with_loss_scaler(current: dict[str, Any], full: FullOptimizerState) -> dict[str, Any]:
    """`current` (a wrapper's own state dict) with the saved loss scaler and overflow flag."""
    if full.loss_scaler is not None:
        current[C.LOSS_SCALER] = full.loss_scaler
        current["overflow"] = full.overflow
    return current


def with_hyperparams(param_groups: list[dict[str, Any]], full: FullOptimizerState) -> list[dict[str, Any]]:
    """This run's param groups (their `params` indices kept) with the saved hyperparameters."""
    if full.param_groups and len(full.param_groups) != len(param_groups):
        raise ValueError(f"the checkpoint has {len(full.param_groups)} optimizer param groups, "
                         f"this run has {len(param_groups)}")
    return [{**group, **(full.param_groups[i] if full.param_groups else {}), "params": group["params"]}
            for i, group in enumerate(param_groups)]


@torch.no_grad()
def copy_into_params(param_names: ParamNames, full_names: dict[str, str], full: FullOptimizerState) -> None:
    """The saved masters straight into the trainable parameters (a wrapper without fp32 copies)."""
    for param, name in param_names.items():
        if param.requires_grad:
            param.copy_(require(full.fp32, full_names[name]))


def require(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"parameter {name!r} is not in the checkpoint's optimizer state")
    return tensors[name]


def cloned(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}


def flat_offsets(params: list[torch.nn.Parameter], names: list[str]) -> dict[str, int]:
    """name -> where the parameter starts in its group's unpartitioned flat buffer."""
    offsets, total = {}, 0
    for param, name in zip(params, names):
        offsets[name] = total
        total += param.numel()
    return offsets
