"""Save and load of the optimizer side of a checkpoint, with re-partitioning on load.

Same stage, same data-parallel size: each rank reads only its own optim file (or, at stage 0, the
model file's `optimizer` entry) and hands it to the wrapper's `load_state_dict`, as DeepSpeed
does. Otherwise (another dp size, another stage, stage 0 saved in another precision) every
rank reads the saved state into the full layout ([Note: full layout] in full_state.py) and cuts
from it the state dict its current wrapper expects: the fp32 masters and moments come back
exactly, whatever the partitioning was.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.full_state import (FullOptimizerState, export_stage0, export_zero3, export_zero12,
                                             fragment_bounds, merge_param_shapes)
from zerospeed.checkpoint.deepspeed_format import stage0_for_deepspeed, stage0_from_deepspeed
from zerospeed.checkpoint.layout import find_model_files, find_optim_files
from zerospeed.checkpoint.manifest import load_file, verify_files
from zerospeed.runtime.zero.param_state import rank_span

__all__ = ["SavedLayout", "discover", "load_optimizer_state", "trainable_names_per_group"]


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What a tag directory holds: its stage, dp size and files (dp-rank order)."""

    tag_dir: str
    zero_stage: int
    dp_world_size: int
    model_files: list[str]
    optim_files: list[str]


def discover(tag_dir: str, bf16_first: bool, mp_rank: int = 0) -> SavedLayout:
    verify_files(tag_dir, checksum=False)   # every listed file present, at its size (checksums: on read)
    model_files = find_model_files(tag_dir)
    if not model_files:
        raise FileNotFoundError(f"no *_model_states.pt file in checkpoint directory {tag_dir}")
    optim_files = find_optim_files(tag_dir, bf16_first, mp_rank)
    if not optim_files:
        return SavedLayout(tag_dir, 0, 1, model_files, [])
    first = load_file(optim_files[0], mmap=True)[C.OPTIMIZER_STATE_DICT]
    stage = int(first.get(C.ZERO_STAGE, 0))
    counts = first[C.PARTITION_COUNT]
    dp_world_size = int(max(counts) if isinstance(counts, list) else counts)
    if len(optim_files) != dp_world_size:
        raise ValueError(f"checkpoint {tag_dir} has {len(optim_files)} optim files, expected {dp_world_size} "
                         f"(its partition_count): a rank's file is missing")
    return SavedLayout(tag_dir, stage, dp_world_size, model_files, optim_files)


# --- what the current wrapper holds ---------------------------------------------------------------
def trainable_names_per_group(engine: Any) -> list[list[str]]:
    """Trainable parameter names per optimizer group, in the wrapper's (flat) order."""
    return [[engine.param_names[p] for p in group] for group in engine.optimizer.trainable_param_groups()]


def stage0_param_names(engine: Any) -> tuple[list[list[str]], list[list[bool]]]:
    """Names of every param in the stage-0 base optimizer's groups (masters named by their lp
    param) and whether each is trainable: the key from torch's indexed state to names."""
    wrapper = engine.optimizer
    name_of = {id(master): engine.param_names[param] for param, master in wrapper.params_and_masters()}
    name_of.update({id(p): n for p, n in engine.param_names.items()})
    names = [[name_of[id(p)] for p in g["params"]] for g in wrapper.optimizer.param_groups]
    trainable = [[p.requires_grad for p in g["params"]] for g in wrapper.optimizer.param_groups]
    return names, trainable


def stage0_optimizer_entry(engine: Any) -> dict[str, Any]:
    """The model file's `optimizer` at stage 0, in DeepSpeed's shape (deepspeed_format.py), with
    the param names that make it reshardable."""
    state = engine.optimizer.state_dict()
    state["param_names"], state["trainable"] = stage0_param_names(engine)
    # masters exist for trainable parameters only: a group's frozen parameters have no fp32 copy
    return stage0_for_deepspeed(state, [sum(flags) for flags in state["trainable"]])


def stage0_wrapper_state(engine: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """A saved stage-0 entry (DeepSpeed's or ours) as our stage-0 wrapper state, named by param.
    DeepSpeed's entry has no names: at stage 0 this run's optimizer order names it (same model,
    same order); loading it at another stage needs the names and raises in export_stage0."""
    at_stage0 = engine.zero_optimization_stage() == 0 and engine.optimizer is not None
    groups = [list(g["params"]) for g in engine.optimizer.optimizer.param_groups] if at_stage0 else None
    state = stage0_from_deepspeed(entry, groups, getattr(engine.optimizer, "clip_grad", 0.0))
    if "param_names" not in state and at_stage0:
        state["param_names"], state["trainable"] = stage0_param_names(engine)
    return state


# --- loading ----------------------------------------------------------------------------------------
def load_optimizer_state(engine: Any, saved: SavedLayout, model_state: dict[str, Any],
                         load_optimizer_states: bool) -> None:
    stage, dp_rank = engine.zero_optimization_stage(), _dp_rank(engine)
    if saved.zero_stage == 0 and model_state.get(C.OPTIMIZER) is not None:
        model_state = {**model_state, C.OPTIMIZER: stage0_wrapper_state(engine, model_state[C.OPTIMIZER])}
    if not load_optimizer_states:
        _restore_weights(engine, saved, model_state)
        return
    same_partitioning = saved.zero_stage == stage and (stage == 0 or saved.dp_world_size == engine.dp_world_size)
    if same_partitioning and not _stage0_precision_changed(engine, saved, model_state):
        if stage == 0:
            engine.optimizer.load_state_dict(model_state[C.OPTIMIZER], load_optimizer_states=True)
        else:
            verify_files(saved.tag_dir, [os.path.basename(saved.optim_files[dp_rank])])
            own = load_file(saved.optim_files[dp_rank])[C.OPTIMIZER_STATE_DICT]
            engine.optimizer.load_state_dict(own, load_optimizer_states=True)
        return
    import_full_state(engine, export_full_state(saved, model_state), load_optimizer_states=True)


def _stage0_precision_changed(engine: Any, saved: SavedLayout, model_state: dict[str, Any]) -> bool:
    if saved.zero_stage != 0:
        return False
    return ("fp32_groups" in (model_state[C.OPTIMIZER] or {})) != bool(engine.optimizer.precision.low_precision)


def export_full_state(saved: SavedLayout, model_state: dict[str, Any]) -> FullOptimizerState:
    if saved.zero_stage == 0:
        return export_stage0(stage0_from_deepspeed(model_state[C.OPTIMIZER], None, 0.0), model_state[C.MODULE])
    if saved.zero_stage in (1, 2):
        verify_files(saved.tag_dir, [os.path.basename(f) for f in saved.optim_files])
        return export_zero12(_each_optim_state(saved), model_state[C.PARAM_SHAPES])
    verify_files(saved.tag_dir, [os.path.basename(f) for f in saved.optim_files])
    naming = None
    if model_state.get(moe_reshard.EP_SIZES_KEY):   # [Note: MoE stage-3 reshard]
        names = list(merge_param_shapes(model_state[C.PARAM_SHAPES]))
        naming = moe_reshard.saved_naming(model_state, names, saved.dp_world_size, saved.tag_dir)
    return export_zero3(_each_optim_state(saved), model_state[C.PARAM_SHAPES], saved.dp_world_size, naming)


def _each_optim_state(saved: SavedLayout) -> Iterator[dict[str, Any]]:
    for path in saved.optim_files:
        yield load_file(path, mmap=True)[C.OPTIMIZER_STATE_DICT]


def _restore_weights(engine: Any, saved: SavedLayout, model_state: dict[str, Any]) -> None:
    """No optimizer state wanted: the weights come from the module file, except when either side is
    ZeRO-3, whose module file holds empty tensors: then from the fp32 masters of the optim files
    (DeepSpeed rebuilds them with zero_to_fp32, §3.8). Moments and loss scale stay fresh."""
    if saved.zero_stage >= 3 or engine.zero_optimization_stage() >= 3:
        masters = FullOptimizerState(fp32=export_full_state(saved, model_state).fp32)
        import_full_state(engine, masters, load_optimizer_states=False)
        return
    _restore_from_module(engine)


def _restore_from_module(engine: Any) -> None:
    """DeepSpeed's `_restore_from_bit16_weights`: fp32 masters re-derived from the module weights."""
    engine.optimizer.refresh_fp32_params()


def import_full_state(engine: Any, full: FullOptimizerState, load_optimizer_states: bool) -> None:
    stage = engine.zero_optimization_stage()
    if stage == 0:
        _import_stage0(engine, full, load_optimizer_states)
    elif stage in (1, 2):
        _import_zero12(engine, full, load_optimizer_states)
    else:
        _import_zero3(engine, full, load_optimizer_states)


def _common(current: dict[str, Any], full: FullOptimizerState) -> dict[str, Any]:
    if full.loss_scaler is not None:
        current[C.LOSS_SCALER] = full.loss_scaler
        current["overflow"] = full.overflow
    return current


def _with_hyperparams(param_groups: list[dict[str, Any]], full: FullOptimizerState) -> list[dict[str, Any]]:
    if full.param_groups and len(full.param_groups) != len(param_groups):
        raise ValueError(f"the checkpoint has {len(full.param_groups)} optimizer param groups, "
                         f"this run has {len(param_groups)}")
    return [{**group, **(full.param_groups[i] if full.param_groups else {}), "params": group["params"]}
            for i, group in enumerate(param_groups)]


def _import_stage0(engine: Any, full: FullOptimizerState, load_optimizer_states: bool) -> None:
    wrapper = engine.optimizer
    current = _common(wrapper.state_dict(), full)
    torch_state = current[C.OPTIMIZER_STATE_DICT]
    names, trainable = stage0_param_names(engine)
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    for group, group_names, group_trainable in zip(torch_state["param_groups"], names, trainable):
        for index, name, is_trainable in zip(group["params"], group_names, group_trainable):
            if not is_trainable:
                continue
            masters.append(_require(full.fp32, name).clone())
            if name in full.moments:
                # one tensor per param: torch's Adam increments `step` in place
                state[index] = {**_cloned(full.scalars.get(name, {})),
                                **{k: v.clone() for k, v in full.moments[name].items()}}
    torch_state["state"] = state
    torch_state["param_groups"] = _with_hyperparams(torch_state["param_groups"], full)
    if "fp32_groups" in current:
        current["fp32_groups"] = masters
    else:
        _copy_into_params(engine, full)
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


@torch.no_grad()
def _copy_into_params(engine: Any, full: FullOptimizerState) -> None:
    for param, name in engine.param_names.items():
        if param.requires_grad:
            param.copy_(_require(full.fp32, name))


def _require(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"parameter {name!r} is not in the checkpoint's optimizer state")
    return tensors[name]


def _import_zero12(engine: Any, full: FullOptimizerState, load_optimizer_states: bool) -> None:
    wrapper = engine.optimizer
    current = _common(wrapper.state_dict(), full)
    dp_rank = _dp_rank(engine)
    base = current[C.BASE_OPTIMIZER_STATE]
    state: dict[int, dict[str, Any]] = {}
    for g, group_names in enumerate(trainable_names_per_group(engine)):
        lean = current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g]
        partition_numel = lean.numel() + int(current[C.GROUP_PADDINGS][g])
        offsets = _flat_offsets(engine, wrapper.trainable_param_groups()[g], group_names)
        group_start = dp_rank * partition_numel
        new_lean = torch.zeros_like(lean)
        moments: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for name, address in current[C.PARAM_SLICE_MAPPINGS][g].items():
            start, numel = fragment_bounds(address)
            param_start = group_start + start - offsets[name]
            new_lean.narrow(0, start, numel).copy_(_require(full.fp32, name).reshape(-1).narrow(0, param_start, numel))
            for key, value in full.moments.get(name, {}).items():
                moment = moments.setdefault(key, torch.zeros(partition_numel, dtype=value.dtype))
                moment.narrow(0, start, numel).copy_(value.reshape(-1).narrow(0, param_start, numel))
            scalars = scalars or _cloned(full.scalars.get(name, {}))
        current[C.SINGLE_PARTITION_OF_FP32_GROUPS][g] = new_lean
        if moments:
            state[base["param_groups"][g]["params"][0]] = {**scalars, **moments}
    base["state"] = state
    base["param_groups"] = _with_hyperparams(base["param_groups"], full)
    current[C.PARTITION_COUNT] = [engine.dp_world_size] * len(current[C.SINGLE_PARTITION_OF_FP32_GROUPS])
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


def _import_zero3(engine: Any, full: FullOptimizerState, load_optimizer_states: bool) -> None:
    """Cut this rank's chunk of every parameter ([Note: full layout]) into its sub-group flats;
    padding stays zero. The wrapper copies the masters into its partitions on load."""
    wrapper = engine.optimizer
    current = _common(wrapper.state_dict(), full)
    dp_rank, base = _dp_rank(engine), current[C.OPTIMIZER_STATE_DICT]
    indices = [index for group in base["param_groups"] for index in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for k, params in enumerate(wrapper.trainable_param_groups()):
        flat = torch.zeros_like(current[C.FP32_FLAT_GROUPS][k])
        moments: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        offset = 0
        for param in params:
            name, world, rank = moe_reshard.import_coords(engine, param, dp_rank)   # experts: [Note: MoE stage-3 reshard]
            start, real_numel = rank_span(param.ds_numel, world, rank)
            flat.narrow(0, offset, real_numel).copy_(_require(full.fp32, name).reshape(-1).narrow(0, start, real_numel))
            for key, value in full.moments.get(name, {}).items():
                moment = moments.setdefault(key, torch.zeros(flat.numel(), dtype=value.dtype))
                moment.narrow(0, offset, real_numel).copy_(value.reshape(-1).narrow(0, start, real_numel))
            scalars = scalars or _cloned(full.scalars.get(name, {}))
            offset += param.partition_numel()
        current[C.FP32_FLAT_GROUPS][k] = flat
        if moments:
            state[indices[k]] = {**scalars, **moments}
    base["state"] = state
    base["param_groups"] = _with_hyperparams(base["param_groups"], full)
    current[C.PARTITION_COUNT] = engine.dp_world_size
    wrapper.load_state_dict(current, load_optimizer_states=load_optimizer_states)


def _cloned(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}


def _flat_offsets(engine: Any, params: list[torch.nn.Parameter], names: list[str]) -> dict[str, int]:
    offsets, total = {}, 0
    for param, name in zip(params, names):
        offsets[name] = total
        total += param.numel()
    return offsets


def _dp_rank(engine: Any) -> int:
    from zerospeed import comm

    return comm.get_rank(engine.dp_group)
