"""The optimizer side of a checkpoint in DeepSpeed 0.19.8's exact shape, and back.

zerospeed's wrappers keep plain state dicts (loss scaler as a dict, stage as an int, fragments
as dicts). DeepSpeed's loaders expect its own objects in those places and, at stage 0, the
state dict of whichever wrapper it would build. So every save passes through the `for_deepspeed`
functions below, and every load of the stage-0 entry through `stage0_from_deepspeed`, which
reads any of DeepSpeed's three stage-0 shapes (and zerospeed's older one):

* fp32, no ZeRO: the bare torch optimizer's `state_dict()` (`state`, `param_groups` at the top);
* bf16/fp16 with a torch optimizer (`FP16_UnfusedOptimizer`): loss-scale scalars,
  `optimizer_state_dict` (one torch param per model param) and `fp32_groups`, a list per param
  group of per-parameter fp32 masters;
* bf16/fp16 with DeepSpeed's FusedAdam (`FP16_Optimizer`): `optimizer_state_dict` over one flat
  fp32 param per group, `fp32_groups_flat` and `clip_grad`.

zerospeed writes the first two (its stage-0 optimizer keeps one master per parameter) plus its
own keys (`param_names`, `trainable`, `loss_scaler`, `overflow`), which DeepSpeed ignores.
`ds_version` in what we write is DeepSpeed's format version we follow (DeepSpeed's stage-1
loader refuses versions before 0.3.17); zerospeed's own version is in the manifest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed_compat import (DeepSpeedDynamicLossScaler, DeepSpeedFragmentAddress,
                                                   DeepSpeedLossScaler, DeepSpeedZeroStage)

__all__ = ["DEEPSPEED_FORMAT_VERSION", "loss_scaler_for_deepspeed", "zero_state_for_deepspeed",
           "stage0_for_deepspeed", "stage0_from_deepspeed"]

DEEPSPEED_FORMAT_VERSION = "0.19.8"
_DYNAMIC_KEYS = ("cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                 "cur_hysteresis", "consecutive_hysteresis")


def loss_scaler_for_deepspeed(state: dict[str, Any]) -> DeepSpeedLossScaler:
    """Our loss-scaler dict as DeepSpeed's (Dynamic)LossScaler object, with every attribute it reads."""
    if not state.get("dynamic"):
        return DeepSpeedLossScaler(cur_scale=float(state["cur_scale"]), dynamic=False)
    return DeepSpeedDynamicLossScaler(cur_scale=float(state["cur_scale"]), dynamic=True,
                                      **{key: state[key] for key in _DYNAMIC_KEYS if key in state},
                                      raise_error_at_min_scale=bool(state.get("raise_error_at_min_scale", True)),
                                      dtype=torch.float16)


def zero_state_for_deepspeed(state: dict[str, Any]) -> dict[str, Any]:
    """A ZeRO 1/2/3 wrapper's `state_dict()` (an optim file's `optimizer_state_dict`) in DeepSpeed's shape."""
    out = dict(state)
    if "loss_scaler" in out:
        out["loss_scaler"] = loss_scaler_for_deepspeed(out["loss_scaler"])
    if "zero_stage" in out:
        out["zero_stage"] = DeepSpeedZeroStage(int(out["zero_stage"]))
    if "param_slice_mappings" in out:
        out["param_slice_mappings"] = [
            OrderedDict((name, DeepSpeedFragmentAddress(numel=int(a["numel"]), start=int(a["start"])))
                        for name, a in group.items()) for group in out["param_slice_mappings"]]
    out["ds_version"] = DEEPSPEED_FORMAT_VERSION
    return out


# --- stage 0: the model file's `optimizer` entry ---------------------------------------------------
def stage0_for_deepspeed(wrapper_state: dict[str, Any], group_sizes: list[int]) -> dict[str, Any]:
    """Our stage-0 wrapper state (`optimizer_state_dict`, `loss_scaler`, optional flat list
    `fp32_groups`, plus `param_names`/`trainable`) as DeepSpeed's bare or unfused entry."""
    ours: dict[str, Any] = {key: wrapper_state[key] for key in ("param_names", "trainable", "loss_scaler", "overflow", "clip_grad")
            if key in wrapper_state}
    torch_state = wrapper_state["optimizer_state_dict"]
    if "fp32_groups" not in wrapper_state:          # fp32: DeepSpeed keeps the bare optimizer
        return {**torch_state, **ours}
    scaler = wrapper_state["loss_scaler"]
    masters = iter(wrapper_state["fp32_groups"])
    entry: dict[str, Any] = {"dynamic_loss_scale": bool(scaler.get("dynamic")), "cur_scale": float(scaler["cur_scale"]),
             "cur_iter": int(scaler.get("cur_iter", 0)), "optimizer_state_dict": torch_state,
             "fp32_groups": [[next(masters) for _ in range(size)] for size in group_sizes]}
    if scaler.get("dynamic"):
        entry.update({key: scaler[key] for key in ("last_overflow_iter", "scale_factor", "scale_window")})
    return {**entry, **ours}


def stage0_from_deepspeed(entry: dict[str, Any], group_params: list[list[torch.Tensor]] | None,
                          clip_grad: float) -> dict[str, Any]:
    """Any stage-0 `optimizer` entry as our wrapper's `load_state_dict` input.

    `group_params` are this run's parameters per optimizer group (the fused shape's flat params
    are cut along them)."""
    if "optimizer_state_dict" not in entry:          # DeepSpeed's bare fp32 optimizer
        torch_state = {"state": entry["state"], "param_groups": entry["param_groups"]}
        return _wrapper_state(entry, torch_state, None, clip_grad)
    if "fp32_groups_flat" in entry:                  # DeepSpeed's FP16_Optimizer (FusedAdam)
        if group_params is None:
            raise ValueError("a stage-0 checkpoint of DeepSpeed's fused FP16_Optimizer loads only at stage 0")
        torch_state, masters = _unflatten_fused(entry, group_params)
        return _wrapper_state(entry, torch_state, masters, entry.get("clip_grad", clip_grad))
    saved_masters = entry.get("fp32_groups")
    if saved_masters and isinstance(saved_masters[0], (list, tuple)):   # DeepSpeed's unfused (and ours now): per group
        saved_masters = [m for group in saved_masters for m in group]
    return _wrapper_state(entry, entry["optimizer_state_dict"], saved_masters, entry.get("clip_grad", clip_grad))


def _wrapper_state(entry: dict[str, Any], torch_state: dict[str, Any], masters: list[torch.Tensor] | None,
                   clip_grad: float) -> dict[str, Any]:
    state: dict[str, Any] = {"optimizer_state_dict": torch_state, "loss_scaler": _loss_scaler_of(entry),
                             "dynamic_loss_scale": bool(entry.get("dynamic_loss_scale", False)),
                             "overflow": bool(entry.get("overflow", False)), "clip_grad": clip_grad}
    if masters is not None:
        state["fp32_groups"] = list(masters)
    for key in ("param_names", "trainable"):
        if key in entry:
            state[key] = entry[key]
    return state


def _loss_scaler_of(entry: dict[str, Any]) -> dict[str, Any]:
    if isinstance(entry.get("loss_scaler"), dict):   # ours: the full state, hysteresis included
        return entry["loss_scaler"]
    scaler = {"cur_scale": float(entry.get("cur_scale", 1.0)), "dynamic": bool(entry.get("dynamic_loss_scale"))}
    scaler.update({key: entry[key] for key in ("cur_iter", "last_overflow_iter", "scale_factor", "scale_window")
                   if key in entry})
    return scaler


def _unflatten_fused(entry: dict[str, Any], group_params: list[list[torch.Tensor]]
                     ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """FP16_Optimizer's one-flat-param-per-group state as one torch param per model param."""
    flat_state = entry["optimizer_state_dict"]
    masters: list[torch.Tensor] = []
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, (flat, params) in enumerate(zip(entry["fp32_groups_flat"], group_params)):
        saved = flat_state["state"].get(flat_state["param_groups"][g]["params"][0], {})
        indices, offset = [], 0
        for param in params:
            numel = param.numel()
            masters.append(flat.narrow(0, offset, numel).view(param.shape).clone())
            if saved:
                state[index] = {k: (v.narrow(0, offset, numel).view(param.shape).clone()
                                    if torch.is_tensor(v) and v.numel() == flat.numel() else v)
                                for k, v in saved.items()}
            indices.append(index)
            index, offset = index + 1, offset + numel
        groups.append({**flat_state["param_groups"][g], "params": indices})
    return {"state": state, "param_groups": groups}, masters
