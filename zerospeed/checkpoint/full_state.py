"""The full (unpartitioned) optimizer state of a checkpoint, keyed by parameter name.

[Note: full layout]
Resharding goes through one representation: for every trainable parameter its full fp32 master
(`fp32[name]`, in the parameter's shape), its per-element optimizer moments
(`moments[name][key]`, e.g. exp_avg, exp_avg_sq) and its scalar state (`scalars[name][key]`,
e.g. step), plus the hyperparameters of each param group. Exporters read saved files of any
stage and data-parallel size into it; importers cut from it the state dict the *current*
wrapper's `load_state_dict` expects (full_state_import.py). A tensor state counts as
per-element when it has as many elements as the partition (stage 1/2), the sub-group flat
(stage 3) or the parameter (stage 0). At stage 3 a parameter of `numel` elements is cut into
ceil(numel / W) elements per rank, at the same offset of every rank's sub-group flat; the last
ranks' chunks end in padding, which the export drops and the import writes as zeros.
The representation holds the whole model's fp32 state on each rank while a resharded load runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.checkpoint import constants as C

__all__ = ["FullOptimizerState", "export_stage0", "export_zero12", "export_zero3", "fragment_bounds",
           "merge_param_shapes", "unite_stage_states"]


@dataclasses.dataclass
class FullOptimizerState:
    fp32: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    moments: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    param_groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    loss_scaler: dict[str, Any] | None = None
    overflow: bool = False


def unite_stage_states(per_stage: list[FullOptimizerState]) -> FullOptimizerState:
    """Every pipeline stage's full-layout state (stage order) as the whole model's: the stages hold
    other parameters (named by global layer index), but for a tied weight, which every stage
    holding it updates alike: the first stage's copy is taken. Hyperparameters and the loss scaler
    are the same on every stage: stage 0's."""
    first = per_stage[0]
    full = FullOptimizerState(param_groups=first.param_groups, loss_scaler=first.loss_scaler,
                              overflow=any(state.overflow for state in per_stage))
    for state in per_stage:
        for name, master in state.fp32.items():
            if name not in full.fp32:
                full.fp32[name] = master
                full.moments[name] = state.moments.get(name, {})
                full.scalars[name] = state.scalars.get(name, {})
    return full


def merge_param_shapes(param_shapes: Any) -> dict[str, torch.Size]:
    """`param_shapes` is a list per group of name -> shape (or one dict); merged in order."""
    groups = param_shapes if isinstance(param_shapes, list) else [param_shapes]
    return {name: torch.Size(shape) for group in groups for name, shape in group.items()}


def fragment_bounds(address: Any) -> tuple[int, int]:
    """(start, numel) of a `param_slice_mappings` entry: our dict, or DeepSpeed's fragment_address."""
    if isinstance(address, dict):
        return int(address["start"]), int(address["numel"])
    return int(address.start), int(address.numel)


def _hyperparams(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def export_stage0(optimizer_state: dict[str, Any], module_state: dict[str, torch.Tensor]) -> FullOptimizerState:
    """From a stage-0 model file's `optimizer` entry (ours: it carries `param_names`)."""
    if "param_names" not in optimizer_state:
        raise ValueError("stage-0 optimizer state has no 'param_names': cannot reshard it by name")
    torch_state = optimizer_state[C.OPTIMIZER_STATE_DICT]
    full = FullOptimizerState(param_groups=_hyperparams(torch_state["param_groups"]),
                              loss_scaler=optimizer_state.get(C.LOSS_SCALER),
                              overflow=bool(optimizer_state.get("overflow", False)))
    masters = iter(optimizer_state.get("fp32_groups") or [])
    has_masters = "fp32_groups" in optimizer_state
    for group, names, trainable in zip(torch_state["param_groups"], optimizer_state["param_names"],
                                       optimizer_state["trainable"]):
        for index, name, is_trainable in zip(group["params"], names, trainable):
            if not is_trainable:
                continue
            full.fp32[name] = (next(masters) if has_masters else module_state[name]).float()
            _split_state(full, name, torch_state["state"].get(index, {}), full.fp32[name].numel(), None)
    _join_moments(full)
    return full


def _join_moments(full: FullOptimizerState) -> None:
    for name, by_key in full.moments.items():
        for key, parts in list(by_key.items()):
            shape = full.fp32[name].shape   # stage 3: the last chunks carry padding past numel
            by_key[key] = torch.cat(parts).narrow(0, 0, math.prod(shape)).view(shape)  # type: ignore[arg-type]


def _split_state(full: FullOptimizerState, name: str, state: dict[str, Any], per_element_numel: int,
                 window: tuple[int, int] | None) -> None:
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.numel() == per_element_numel:
            piece = value.reshape(-1) if window is None else value.reshape(-1).narrow(0, *window)
            full.moments.setdefault(name, {}).setdefault(key, [])  # type: ignore[arg-type]
            full.moments[name][key].append(piece)  # type: ignore[attr-defined]
        else:
            full.scalars.setdefault(name, {})[key] = value


def export_zero12(optim_states: Iterable[dict[str, Any]], param_shapes: Any,
                  naming: Any = None) -> FullOptimizerState:
    """From every rank's ZeRO 1/2 `optimizer_state_dict`, read one at a time in dp-rank order.
    `naming` (MoE, [Note: MoE stage-3 reshard]): `naming.rename(dp_rank, name)` is a saved parameter's
    name in the full state (an expert's global id). A parameter's fragments follow each other in rank
    order over the ranks that partition it (for an expert, its expert-data-parallel group)."""
    shapes = merge_param_shapes(param_shapes)
    full = FullOptimizerState()
    pieces: dict[str, list[torch.Tensor]] = {}
    saved_name: dict[str, str] = {}   # full-state name -> the name its shape is saved under
    for dp_rank, state in enumerate(optim_states):
        if dp_rank == 0:
            base = state[C.BASE_OPTIMIZER_STATE]
            full.param_groups = _hyperparams(base["param_groups"])
            full.loss_scaler, full.overflow = state.get(C.LOSS_SCALER), bool(state.get("overflow", False))

        def rename(name: str, rank: int = dp_rank) -> str:
            renamed = name if naming is None else naming.rename(rank, name)
            saved_name[renamed] = name
            return renamed
        _export_zero12_rank(state, full, pieces, first_rank=dp_rank == 0, rename=rename)
    for name, parts in pieces.items():
        full.fp32[name] = torch.cat(parts).view(shapes[saved_name[name]])
    _join_moments(full)
    return full


def _export_zero12_rank(state: dict[str, Any], full: FullOptimizerState, pieces: dict[str, list[torch.Tensor]],
                        first_rank: bool, rename: Any) -> None:
    base = state[C.BASE_OPTIMIZER_STATE]
    for g, lean in enumerate(state[C.SINGLE_PARTITION_OF_FP32_GROUPS]):
        partition_numel = lean.numel() + int(state[C.GROUP_PADDINGS][g])
        group_state = base["state"].get(base["param_groups"][g]["params"][0], {})
        for local_name, address in state[C.PARAM_SLICE_MAPPINGS][g].items():
            name = rename(local_name)
            start, numel = fragment_bounds(address)
            pieces.setdefault(name, []).append(lean.narrow(0, start, numel).float())
            scalars_before = dict(full.scalars.get(name, {}))
            _split_state(full, name, group_state, partition_numel, (start, numel))
            if not first_rank and scalars_before:
                full.scalars[name] = scalars_before   # scalar state is the same on every rank: keep rank 0's


def export_zero3(optim_states: Iterable[dict[str, Any]], param_shapes: Any, dp_world_size: int,
                 naming: Any = None) -> FullOptimizerState:
    """From every rank's ZeRO-3 `optimizer_state_dict`, read one at a time in dp-rank order.
    `param_shapes` is one name -> shape dict per sub-group, in flat order (the model file's).
    `naming` (MoE, [Note: MoE stage-3 reshard]): each parameter's partition size and full-state name."""
    groups = param_shapes if isinstance(param_shapes, list) else [param_shapes]
    full = FullOptimizerState()
    pieces: dict[str, list[torch.Tensor]] = {}
    full_shapes: dict[str, Any] = {}
    for dp_rank, state in enumerate(optim_states):
        base = state[C.OPTIMIZER_STATE_DICT]
        if dp_rank == 0:
            full.param_groups = _hyperparams(base["param_groups"])
            full.loss_scaler, full.overflow = state.get(C.LOSS_SCALER), bool(state.get("overflow", False))
        indices = [index for group in base["param_groups"] for index in group["params"]]
        for k, (flat, shapes) in enumerate(zip(state[C.FP32_FLAT_GROUPS], groups)):
            sub_group_state = base["state"].get(indices[k], {})
            offset = 0
            for local_name, shape in shapes.items():
                world = dp_world_size if naming is None else naming.partition_world(local_name)
                name = local_name if naming is None else naming.rename(dp_rank, local_name)
                full_shapes[name] = torch.Size(shape)
                chunk_numel = -(-math.prod(shape) // world)
                pieces.setdefault(name, []).append(flat.narrow(0, offset, chunk_numel).float())
                scalars_before = dict(full.scalars.get(name, {}))
                _split_state(full, name, sub_group_state, flat.numel(), (offset, chunk_numel))
                if scalars_before and (dp_rank > 0 or naming is not None):
                    full.scalars[name] = scalars_before   # the same on every rank: keep the first's
                offset += chunk_numel
    for name, shape in full_shapes.items():
        full.fp32[name] = torch.cat(pieces[name]).narrow(0, 0, math.prod(shape)).view(shape)
    _join_moments(full)
    return full
