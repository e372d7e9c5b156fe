"""Which parameters Muon steps, and the param groups the `optimizer` block's Muon settings make.

DeepSpeed's rules (`deepspeed.set_optimizer_flags`, `DeepSpeedEngine._muon_param_groups`):
- A parameter is a Muon matrix when its layer shape has >= 2 dims and its name contains neither
  "embed" nor "lm_head"; everything else (embeddings, the head, biases, norms) is AdamW's. The
  layer shape is `ds_shape` under `zero.Init`, where the data is a flat placeholder (PR#8438).
  zerospeed keeps a `use_muon` the user set on a parameter before `initialize` (DeepSpeed
  overwrites it); a 1-D parameter marked True is an error.
- Every incoming param group splits into a Muon half and an Adam half (Muon first; a half with no
  trainable parameter is dropped). Settings are resolved most-specific-last: the block's shared
  value, then `muon_lr` / `adam_lr`, then the incoming group's own keys. `weight_decay` reaches
  both halves, `momentum` / `ns_method` / `ns_steps` / `nesterov` the Muon half, `betas` / `eps`
  the Adam half. An MoE expert group (`moe: True`) keeps its name on both halves: it names the
  expert group whose expert-data-parallel ranks own its matrices.

`per_head_muon` is read where the parameters are tagged (per_head.py, [Note: per-head Muon]).
Keys of the block outside these are refused by name: DeepSpeed drops them silently.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

__all__ = ["MUON_BLOCK_KEYS", "build_muon_optimizer", "is_muon_matrix", "muon_param_groups", "tag_muon_params"]

_MUON_HALF_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "ns_steps", "nesterov")
_ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")
_NON_MUON_NAMES = ("embed", "lm_head")
# Keys that pick an implementation of the same AdamW arithmetic (DeepSpeed: FusedAdam or torch's).
_IMPLEMENTATION_KEYS = ("torch_adam",)
MUON_BLOCK_KEYS = tuple(sorted({*_MUON_HALF_KEYS, *_ADAM_HALF_KEYS, "muon_lr", "adam_lr", "adam_w_mode",
                                "per_head_muon", *_IMPLEMENTATION_KEYS}))


def _layer_shape(param: torch.Tensor) -> tuple[int, ...]:
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if ds_shape is None else tuple(ds_shape)


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule: a >= 2-D layer shape, and not an embedding or the output head."""
    return len(_layer_shape(param)) >= 2 and not any(word in name.lower() for word in _NON_MUON_NAMES)


def tag_muon_params(module: torch.nn.Module) -> None:
    """Set `use_muon` on every parameter of `module` that has none yet (see the module note)."""
    for name, param in module.named_parameters():
        if not hasattr(param, "use_muon"):
            param.use_muon = is_muon_matrix(name, param)   # type: ignore[attr-defined]
        elif param.use_muon and len(_layer_shape(param)) < 2:   # type: ignore[attr-defined]
            raise ValueError(f"parameter {name!r} of shape {_layer_shape(param)} is marked use_muon=True, but "
                             "Muon orthogonalizes matrices: set use_muon=False (AdamW steps it)")


def _check_block(params: dict[str, Any]) -> None:
    unknown = sorted(set(params) - set(MUON_BLOCK_KEYS))
    if unknown:
        raise ValueError(f"optimizer.params {unknown} not accepted for the Muon optimizer (DeepSpeed would ignore "
                         f"them silently); accepted: {list(MUON_BLOCK_KEYS)}")
    if not isinstance(params.get("per_head_muon", False), bool):
        raise ValueError(f"optimizer.params.per_head_muon must be true or false, got {params['per_head_muon']!r}")


def _half_defaults(params: dict[str, Any], keys: tuple[str, ...], lr_key: str) -> dict[str, Any]:
    settings = {key: params[key] for key in keys if key in params}
    if lr_key in params:
        settings["lr"] = params[lr_key]
    return settings


def muon_param_groups(model_parameters: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The Muon and Adam halves of each incoming group (see the module note)."""
    items = list(model_parameters)
    groups = [item for item in items if isinstance(item, dict)]
    loose = [item for item in items if not isinstance(item, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    untagged = [p for group in groups for p in group["params"] if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(f"the Muon optimizer needs use_muon on every parameter and {len(untagged)} have none: "
                         "model_parameters holds parameters the model does not; set param.use_muon = True / False")
    halves = ((True, "muon", _half_defaults(params, _MUON_HALF_KEYS, "muon_lr"), _MUON_HALF_KEYS),
              (False, "adam", _half_defaults(params, _ADAM_HALF_KEYS, "adam_lr"), _ADAM_HALF_KEYS))
    result = []
    for index, group in enumerate(groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, defaults, keys in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = {**defaults, **{key: value for key, value in group.items() if key in keys}}
            prefix = group.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            # An MoE group's halves keep its name, the expert group's, by which the ZeRO wrappers
            # find the expert-data-parallel group its matrices are partitioned and owned in.
            moe = {"moe": True, "name": group["name"]} if group.get("moe") else {}
            result.append({"params": half, "use_muon": use_muon, "name": name, **settings, **moe})
    return result


def build_muon_optimizer(params: dict[str, Any] | None, model_parameters: Any) -> MuonWithAuxAdam:
    """The `{"type": "Muon", "params": {...}}` block's optimizer over `model_parameters`."""
    params = dict(params or {})
    _check_block(params)
    return MuonWithAuxAdam(muon_param_groups(model_parameters, params),
                           adam_w_mode=bool(params.get("adam_w_mode", True)))
