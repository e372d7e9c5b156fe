"""Partitioning parameters: conversion, the gather / release primitives, `zero.Init`,
`GatheredParameters` and external parameters (reference §5.1).

Invariants
- Every rank converts the same parameters in the same order, so `ds_id`s agree across ranks and
  a coalesced gather (params sorted by `ds_id`) is the same collective on every rank.
- A gather is one `all_gather_into_tensor` per dtype: rank r contributes the concatenation of its
  partitions; the full parameter i is rebuilt from chunk i of every rank's slice, cut at numel.
- A release only drops `param.data`; the partition (`ds_tensor`) is the truth. After the module
  or user changed the full data, `has_been_updated=True` copies this rank's slice back first.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Self

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator  # noqa: F401 - at DeepSpeed's path (transformers reads it)
from zerospeed.runtime.zero.param_state import (
    ZeroParameter,
    ZeroParamState,
    ZeroParamStatus,
    attach_state,
    is_zero_param,
    partition_numel,
    rank_span,
    set_status,
)
from zerospeed.runtime.zero.tensor_constructors import (  # noqa: F401 - DeepSpeed's names, read by transformers
    _orig_torch_arange,
    zero_wrapper_for_fp_tensor_constructor,
)

__all__ = ["GatherHandle", "GatheredParameters", "Init", "convert_to_zero_param", "gather_params",
           "register_external_parameter", "release_params", "unregister_external_parameter"]

_ds_ids = itertools.count()  # unique across every model this process builds, same order on every rank


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


# --- conversion ------------------------------------------------------------------------------------

@torch.no_grad()
def convert_to_zero_param(param: torch.nn.Parameter, group: Any = None, name: str = "",
                          persist: bool = False, broadcast: bool = True) -> ZeroParameter:
    """Partition a full parameter in place: keep this rank's slice, drop the rest unless `persist`."""
    if is_zero_param(param):
        return param  # type: ignore[return-value]
    group = group if group is not None else comm.get_world_group()
    world_size, dp_rank = comm.get_world_size(group), comm.get_rank(group)
    if broadcast and world_size > 1:
        comm.broadcast(param.data, src=comm.get_global_rank(group, 0), group=group)
    flat = param.data.reshape(-1)
    start, real = rank_span(flat.numel(), world_size, dp_rank)
    part = torch.zeros(partition_numel(flat.numel(), world_size), dtype=flat.dtype, device=flat.device)
    part[:real].copy_(flat[start:start + real])
    state = ZeroParamState(ds_id=next(_ds_ids), shape=param.shape, numel=param.numel(),
                           world_size=world_size, dp_rank=dp_rank, group=group, partition=part,
                           name=name, persist=persist)
    zparam = attach_state(param, state)
    if not persist:
        _drop_data(zparam)
    return zparam


def _drop_data(param: ZeroParameter) -> None:
    param.data = _empty_like(param.zs_state.partition)
    set_status(param, ZeroParamStatus.NOT_AVAILABLE)


# --- gather / release --------------------------------------------------------------------------------

class GatherHandle:
    """An outstanding coalesced gather; `wait()` rebuilds the full params and makes them AVAILABLE."""

    def __init__(self, params: list[ZeroParameter], work: Any, output: torch.Tensor | None) -> None:
        self.params = params
        self._work = work
        self._output = output
        self.numel = sum(p.zs_state.numel for p in params)

    def wait(self) -> None:
        if self._output is None:
            return
        if self._work is not None:
            self._work.wait()  # the only call made on the handle (gloo, peer-figures.md)
        world_size = self.params[0].zs_state.world_size
        rows = self._output.view(world_size, -1)
        offset = 0
        for param in self.params:
            state = param.zs_state
            size = state.partition_numel
            full = rows[:, offset:offset + size].reshape(-1)[:state.numel]
            param.data = full.view(state.shape)
            set_status(param, ZeroParamStatus.AVAILABLE)
            offset += size
        self._output = None


def gather_params(params: Iterable[torch.nn.Parameter], async_op: bool = False) -> MultiGatherHandle:
    """Start gathering the NOT_AVAILABLE ones among `params` (one collective per dtype)."""
    todo = sorted({id(p): p for p in params if is_zero_param(p)
                   and p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE}.values(),
                  key=lambda p: p.zs_state.ds_id)
    by_dtype: dict[torch.dtype, list[ZeroParameter]] = {}
    for param in todo:
        by_dtype.setdefault(param.zs_state.partition.dtype, []).append(param)  # type: ignore[union-attr]
    handles = [_gather_same_dtype(group, async_op) for group in by_dtype.values()]
    return MultiGatherHandle(handles)


def compute_device() -> torch.device:
    from zerospeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _gather_same_dtype(params: list[ZeroParameter], async_op: bool) -> GatherHandle:
    for param in params:
        set_status(param, ZeroParamStatus.INFLIGHT)
    state = params[0].zs_state
    local = _local_partitions(params)
    # Partitions may live in host memory (offload_param); the gather runs on the compute device.
    device = compute_device()
    local = local.to(device, non_blocking=True)
    output = torch.empty(local.numel() * state.world_size, dtype=local.dtype, device=device)
    work = comm.all_gather_into_tensor(output, local, group=state.group, async_op=async_op)
    return GatherHandle(params, work if async_op else None, output)


def _local_partitions(params: list[ZeroParameter]) -> torch.Tensor:
    """This rank's partitions of `params`, end to end (read from NVMe for swapped ones)."""
    states = [p.zs_state for p in params]
    if all(s.swapped is None for s in states):
        return torch.cat([s.partition for s in states]) if len(states) > 1 else states[0].partition
    local = torch.empty(sum(s.partition_numel for s in states), dtype=states[0].partition.dtype)
    offset = 0
    for state in states:
        piece = local.narrow(0, offset, state.partition_numel)
        if state.swapped is not None:
            state.swapped.swapper.read_into(state.swapped, piece)
        else:
            piece.copy_(state.partition)
        offset += state.partition_numel
    return local


def store_partition(state: ZeroParamState, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full (flattened) `full` into the partition, wherever it lives."""
    start, real = rank_span(state.numel, state.world_size, state.dp_rank)
    values = full.reshape(-1)[start:start + real]
    if state.swapped is None:
        state.partition[:real].copy_(values)
        return
    padded = torch.zeros(state.partition_numel, dtype=state.partition.dtype)
    padded[:real].copy_(values)
    swapped = state.swapped
    swapped.swapper.write_range(swapped.flat_id, swapped.offset, padded, wait=True)


class MultiGatherHandle:
    def __init__(self, handles: list[GatherHandle]) -> None:
        self.handles = handles
        self.params = [p for h in handles for p in h.params]
        self.numel = sum(h.numel for h in handles)

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


@torch.no_grad()
def release_params(params: Iterable[torch.nn.Parameter], has_been_updated: bool = False) -> None:
    """AVAILABLE -> NOT_AVAILABLE (persistent ones only refresh their partition when updated)."""
    for param in params:
        if not is_zero_param(param) or param.zs_state.status is not ZeroParamStatus.AVAILABLE:
            continue
        state = param.zs_state
        if has_been_updated:
            store_partition(state, param.data)
        if state.active_sub_modules and not state.persist:
            raise RuntimeError(f"cannot partition parameter {state.describe()}: still in use by "
                               f"modules {sorted(state.active_sub_modules)}")
        if not state.persist:
            _drop_data(param)


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
        _external_params(module)[parameter.zs_state.ds_id] = parameter  # type: ignore[index]


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not is_zero_param(parameter):
        return
    table = _external_params(module)
    if parameter.zs_state.ds_id not in table:  # type: ignore[union-attr]
        raise ValueError(f"parameter {parameter.zs_state.describe()} is not an external parameter "
                         f"of {type(module).__name__}")
    del table[parameter.zs_state.ds_id]  # type: ignore[union-attr]


def external_parameters(module: torch.nn.Module) -> list[ZeroParameter]:
    return list(module.__dict__.get("_zs_external_params", {}).values())


# --- GatheredParameters ------------------------------------------------------------------------------

class GatheredParameters:
    """Gather `params` for the body of a `with`; with `modifier_rank`, that rank's edits are kept.

    On exit with `modifier_rank` set, each parameter is broadcast from that rank and every rank
    re-partitions from the broadcast data, so the edit is visible, partitioned, everywhere. With
    `modifier_rank=None` edits are discarded (the partitions are unchanged).
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
        self._gathered: list[ZeroParameter] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        if self.fwd_module is not None:
            for param in self.params:
                register_external_parameter(self.fwd_module, param)
        self._gathered = [p for p in self.params if p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE]
        for param in self.params:
            if param.zs_state.status is ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"GatheredParameters: {param.zs_state.describe()} is being gathered "
                                   "by the coordinator; nested use during forward is not supported")
        gather_params(self._gathered).wait()

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None:
            self._publish_from(self.modifier_rank)
        release_params(self._gathered, has_been_updated=self.modifier_rank is not None)

    @torch.no_grad()
    def _publish_from(self, modifier_rank: int) -> None:
        gathered_ids = {id(p) for p in self._gathered}
        for param in self.params:
            state = param.zs_state
            if state.world_size > 1:
                comm.broadcast(param.data, src=comm.get_global_rank(state.group, modifier_rank),
                               group=state.group)
            if id(param) in gathered_ids:
                continue
            # Already gathered before we entered (e.g. persistent): refresh the partition, keep data.
            store_partition(state, param.data)


# --- zero.Init ---------------------------------------------------------------------------------------

def _all_module_classes() -> Iterator[type]:
    seen: set[type] = set()
    pending = [torch.nn.Module]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
                yield sub


class Init:
    """`with zero.Init(): model = Model()` builds `model` already partitioned.

    Every `nn.Module` subclass's `__init__` is wrapped while the context is active; when the
    outermost `__init__` of a module object returns, its direct parameters are broadcast from rank 0
    of the group and partitioned. A module's parameters therefore exist whole only while that module
    is being constructed: no rank ever holds the full model. `module=` partitions an existing model.
    `peak_full_numel` records the most full-parameter elements alive at any post-init point (tests).
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **_: Any) -> None:
        self.enabled = enabled
        self.group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None)
        self.dtype = dtype
        self.device = _target_device(remote_device)
        self.persistence_threshold = _persistence_threshold(config_dict_or_path or config)
        self._patched: dict[type, Any] = {}
        self._live_full: dict[int, int] = {}
        self.peak_full_numel = 0
        if module is not None and enabled:
            self._ensure_dist()
            for child in module.modules():
                self._partition_module(child)

    def _ensure_dist(self) -> None:
        if not comm.is_initialized():
            comm.init_distributed()
        if self.group is None:
            self.group = comm.get_world_group()

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        self._ensure_dist()
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                self._patch(cls)
        self._patch_init_subclass()
        return self

    def _patch_init_subclass(self) -> None:
        """Classes defined inside the context get their __init__ wrapped as well."""
        original = torch.nn.Module.__dict__.get("__init_subclass__")
        self._original_init_subclass = original
        init_ctx = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            if original is not None:
                original.__func__(cls, **kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            if "__init__" in cls.__dict__:
                init_ctx._patch(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._original_init_subclass  # type: ignore[assignment]
        for cls, original in self._patched.items():
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()

    def _patch(self, cls: type) -> None:
        if cls in self._patched:
            return
        original = cls.__dict__["__init__"]
        self._patched[cls] = original
        init_ctx = self

        @functools.wraps(original)
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_zs_init_depth", 0)
            module.__dict__["_zs_init_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_zs_init_depth"] = depth
            if depth == 0:
                del module.__dict__["_zs_init_depth"]
                init_ctx._partition_module(module)

        cls.__init__ = wrapped  # type: ignore[misc]

    @torch.no_grad()
    def _partition_module(self, module: torch.nn.Module) -> None:
        full_now = sum(p.numel() for p in module.parameters(recurse=False) if not is_zero_param(p))
        self.peak_full_numel = max(self.peak_full_numel, sum(self._live_full.values()) + full_now)
        for name, param in list(module._parameters.items()):
            if param is None or is_zero_param(param):
                continue
            if self.dtype is not None and param.is_floating_point():
                param.data = param.data.to(self.dtype)
            param.data = param.data.to(self.device)  # partitions live on the accelerator (or remote_device)
            persist = param.numel() <= self.persistence_threshold
            convert_to_zero_param(param, self.group, name=f"{type(module).__name__}.{name}", persist=persist)
            if persist:
                self._live_full[param.zs_state.ds_id] = param.numel()  # type: ignore[union-attr]


def _target_device(remote_device: Any) -> torch.device:
    if remote_device is not None and str(remote_device) not in ("none", "OffloadDeviceEnum.none"):
        return torch.device("cpu")  # cpu / nvme offload: partitions stay in host memory
    from zerospeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _persistence_threshold(config: Any) -> int:
    """zero.Init keeps params of at most `param_persistence_threshold` elements whole (0: none)."""
    if config is None:
        return 0
    if isinstance(config, str):
        import json

        with open(config) as handle:
            config = json.load(handle)
    if isinstance(config, dict):
        zero = config.get("zero_optimization", {}) or {}
        return int(zero.get("param_persistence_threshold", zero.get("stage3_param_persistence_threshold", 100_000)))
    zero = getattr(config, "zero_config", None)
    return int(getattr(zero, "param_persistence_threshold", 0)) if zero is not None else 0


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
                key = param.zs_state.ds_id if is_zero_param(param) else id(param)  # type: ignore[union-attr]
                if key not in by_ds_id:
                    by_ds_id[key] = param.detach().cpu().clone()
                state[prefix + name] = by_ds_id[key]
        if is_source:
            for name, buffer in child._buffers.items():
                if buffer is not None and name not in child._non_persistent_buffers_set:
                    state[prefix + name] = buffer.detach().cpu().clone()
    return state if is_source else None
