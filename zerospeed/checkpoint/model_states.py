"""The model-states file (reference §7.2), built from an engine, in plain types only.

Beyond DeepSpeed: frozen parameters are kept at stage 1 too (DeepSpeed drops them there), and the
stage-0 file carries `param_shapes` and the optimizer's param names so it can be resharded and
merged by zero_to_fp32 like a ZeRO checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.deepspeed_format import DEEPSPEED_FORMAT_VERSION
from zerospeed.checkpoint.zero_checkpoint import stage0_optimizer_entry

__all__ = ["build_model_states", "persistent_buffer_names", "shared_param_names"]


def persistent_buffer_names(module: torch.nn.Module) -> list[str]:
    names = []
    for prefix, submodule in module.named_modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def shared_param_names(module: torch.nn.Module) -> dict[str, str]:
    """{alias: owner} for tied parameters; the owner is the name `named_parameters` keeps."""
    owner_of: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in owner_of:
            shared[name] = owner_of[id(param)]
        else:
            owner_of[id(param)] = name
    return shared


def _param_shapes(engine: Any) -> list[OrderedDict[str, torch.Size]]:
    return [OrderedDict(group) for group in engine.optimizer.param_shapes(engine.param_names)]


def _frozen(engine: Any) -> tuple[OrderedDict[str, torch.Size], dict[str, torch.Tensor]]:
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    return (OrderedDict((n, getattr(p, "ds_shape", p.shape)) for n, p in frozen),
            {n: getattr(p, "ds_tensor", p).detach().cpu() for n, p in frozen})


def _module_state(engine: Any, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    state = engine.module.state_dict()
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        # A ZeRO-3 parameter's weights live in the optim files; DeepSpeed's file holds a (0,)
        # placeholder, also for a parameter that is whole at the moment (persistent, or gathered),
        # and its loader copies the module entry into the (partitioned) parameter: a full tensor
        # there would not fit.
        if hasattr(param, "ds_id") and name in state:
            state[name] = torch.empty(0, dtype=param.dtype)
    if exclude_frozen:
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
    return state


def build_model_states(engine: Any, client_state: dict[str, Any], exclude_frozen: bool) -> dict[str, Any]:
    for key in client_state:
        if key in C.RESERVED_CLIENT_KEYS:
            raise KeyError(f"client_state key {key!r} is reserved by the checkpoint format")
    stage = engine.zero_optimization_stage()
    frozen_shapes, frozen_fragments = (None, None) if exclude_frozen or stage == 0 else _frozen(engine)
    optimizer = engine.optimizer
    state: dict[str, Any] = {
        C.MODULE: _module_state(engine, exclude_frozen),
        C.BUFFER_NAMES: persistent_buffer_names(engine.module),
        C.OPTIMIZER: stage0_optimizer_entry(engine) if stage == 0 and optimizer is not None else None,
        C.PARAM_SHAPES: _param_shapes(engine) if optimizer is not None else None,
        C.FROZEN_PARAM_SHAPES: frozen_shapes,
        C.FROZEN_PARAM_FRAGMENTS: frozen_fragments,
        C.SHARED_PARAMS: shared_param_names(engine.module),
        C.LR_SCHEDULER: engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        C.DATA_SAMPLER: None,
        C.RANDOM_LTD: None,
        C.SKIPPED_STEPS: engine.skipped_steps,
        C.GLOBAL_STEPS: engine.global_steps,
        C.GLOBAL_SAMPLES: engine.global_samples,
        C.DP_WORLD_SIZE: getattr(engine, "seq_dp_world_size", engine.dp_world_size),   # DeepSpeed's: sp x dp
        C.MP_WORLD_SIZE: getattr(engine, "mp_world_size", 1),   # the tp size under AutoTP
        C.CHECKPOINT_PARALLEL_DIMENSIONS: {"pp_degree": 1, "tp_degree": getattr(engine, "mp_world_size", 1)},
        C.DS_CONFIG: engine._config._param_dict,
        C.DS_VERSION: DEEPSPEED_FORMAT_VERSION,   # the format we follow; zerospeed's version: manifest
    }
    if getattr(engine, "tensor_parallel", None) is not None:   # [Note: AutoTP checkpoint layout]
        from zerospeed.runtime.tensor_parallel.checkpoint import TP_SHARDS_KEY, shard_record

        state[TP_SHARDS_KEY] = shard_record(engine.module)
    state.update(client_state)
    return state


def to_plain(obj: Any) -> Any:
    """Enums (e.g. a wrapper's `ZeroStageEnum`) become their values, so files stay weights-only loadable."""
    import enum

    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return type(obj)((k, to_plain(v)) for k, v in obj.items()) if isinstance(obj, OrderedDict) else {
            k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_plain(v) for v in obj)
    return obj
