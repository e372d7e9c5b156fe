"""Partitioning parameters: `GatheredParameters`, external parameters and the consolidated 16-bit
state dict (DeepSpeed's runtime/zero/partition_parameters.py). The gather / release primitives are
in param_gather.py, `zero.Init` in zero_init.py and conversion in param_conversion.py, all
re-exported here at DeepSpeed's path.

Every rank converts the same parameters in the same order, so `ds_id`s agree across ranks and a
coalesced gather (params sorted by `ds_id`) is the same collective on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator  # noqa: F401 - also at DeepSpeed's path: transformers reads it here
from zerospeed.runtime.zero.param_conversion import convert_to_zero_param
from zerospeed.runtime.zero.param_gather import (  # noqa: F401 - re-exported: their callers import them here
    IN_PLACE_PACK_BYTES,
    GatherHandle,
    MultiGatherHandle,
    compute_device,
    gather_params,
    release_params,
    store_partition,
)
from zerospeed.runtime.zero.param_state import ZeroParameter, ZeroParamStatus, drop_data, is_zero_param
from zerospeed.runtime.zero.tensor_constructors import (  # noqa: F401 - DeepSpeed's names, read by transformers
    _orig_torch_arange,
    zero_wrapper_for_fp_tensor_constructor,
)

__all__ = ["GatherHandle", "GatheredParameters", "Init", "convert_to_zero_param", "gather_params",
           "register_external_parameter", "release_params", "unregister_external_parameter"]


# --- external parameters -----------------------------------------------------------------------------

def _external_params(module: torch.nn.Module) -> dict[int, ZeroParameter]:
    if "_zs_external_params" not in module.__dict__:
        module.__dict__["_zs_external_params"] = {}
    return module.__dict__["_zs_external_params"]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Fetch `parameter` with `module` (it is used in `module.forward` but owned elsewhere)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter)}")
    if is_zero_param(parameter):
        _external_params(module)[parameter.zs_state.ds_id] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not is_zero_param(parameter):
        return
    table = _external_params(module)
    if parameter.zs_state.ds_id not in table:
        raise ValueError(f"parameter {parameter.zs_state.describe()} is not an external parameter "
                         f"of {type(module).__name__}")
    del table[parameter.zs_state.ds_id]


def external_parameters(module: torch.nn.Module) -> list[ZeroParameter]:
    return list(module.__dict__.get("_zs_external_params", {}).values())


# --- GatheredParameters ------------------------------------------------------------------------------

class GatheredParameters:
    """Gather `params` for the body of a `with`; with `modifier_rank`, that rank's edits are kept.

    On exit every parameter goes back to its partition, persistent ones included (DeepSpeed's
    `GatheredParameters.__exit__` partitions all of them; the next use re-gathers). With
    `modifier_rank` set, each parameter is first broadcast from that rank and every rank stores its
    slice of the broadcast data, so the edit is visible, partitioned, everywhere. With
    `modifier_rank=None` edits are discarded: the partitions are unchanged. A parameter a module is
    computing with at this moment (gathered by the coordinator during forward) stays gathered.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        unique = {id(p): p for p in (params or []) if is_zero_param(p)}
        self.params: list[ZeroParameter] = sorted(unique.values(), key=lambda p: p.zs_state.ds_id)
        self.enabled = enabled and bool(self.params)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module

    def __enter__(self) -> None:
        if not self.enabled:
            return
        if self.fwd_module is not None:
            for param in self.params:
                register_external_parameter(self.fwd_module, param)
        for param in self.params:
            if param.zs_state.status is ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"GatheredParameters: {param.zs_state.describe()} is being gathered "
                                   "by the coordinator; nested use during forward is not supported")
        gather_params([p for p in self.params if p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE]).wait()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None:
            self._publish_from(self.modifier_rank)
        for param in self.params:
            if param.zs_state.status is ZeroParamStatus.AVAILABLE and not param.zs_state.active_sub_modules:
                drop_data(param)

    @torch.no_grad()
    def _publish_from(self, modifier_rank: int) -> None:
        for param in self.params:
            state = param.zs_state
            if state.world_size > 1:
                comm.broadcast(param.data, src=comm.get_global_rank(state.group, modifier_rank),
                               group=state.group)
            store_partition(state, param.data)


# --- consolidation (save_16bit_model) ----------------------------------------------------------------

def consolidated_16bit_state_dict(module: torch.nn.Module, exclude_frozen_parameters: bool = False,
                                  group: Any = None) -> dict[str, torch.Tensor] | None:
    """The full state_dict on rank 0 of `group` (None elsewhere), one module's params gathered at a
    time so no rank holds more than one module whole beyond the result; tied params share a tensor."""
    is_source = comm.get_rank(group) == 0
    state: dict[str, torch.Tensor] = {}
    by_ds_id: dict[int, torch.Tensor] = {}
    for prefix, child in module.named_modules():
        prefix = f"{prefix}." if prefix else ""
        params = [(n, p) for n, p in child._parameters.items() if p is not None]
        with GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, param in params:
                if exclude_frozen_parameters and not param.requires_grad:
                    continue
                if not is_source:
                    continue
                key = param.zs_state.ds_id if is_zero_param(param) else id(param)
                if key not in by_ds_id:
                    by_ds_id[key] = param.detach().cpu().clone()
                state[prefix + name] = by_ds_id[key]
        if is_source:
            for name, buffer in child._buffers.items():
                if buffer is not None and name not in child._non_persistent_buffers_set:
                    state[prefix + name] = buffer.detach().cpu().clone()
    return state if is_source else None


# DeepSpeed's path for zero.Init (deepspeed.runtime.zero.partition_parameters.Init); it lives in zero_init.py.
from zerospeed.runtime.zero.zero_init import Init  # noqa: E402
