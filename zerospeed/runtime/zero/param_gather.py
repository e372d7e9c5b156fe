"""The gather and release primitives of ZeRO-3 parameters (DeepSpeed's `all_gather_coalesced` /
`partition` of partition_parameters.py): NOT_AVAILABLE -> INFLIGHT -> AVAILABLE and back.

Invariants
- A gather is one `all_gather_into_tensor` per dtype and process group: rank r contributes the
  concatenation of its partitions; the full parameter i is rebuilt from chunk i of every rank's
  slice, cut at numel. With gloo it is one in-place all-gather per buffer of up to 1 MiB of
  parameters, or per larger parameter (`_gather_in_place`): the same bits, without gloo's per-call
  temporaries or the copy out. Parameters are sorted by `ds_id`, so it is the same collective on
  every rank.
- A release only drops `param.data`; the partition (`ds_tensor`) is the truth. After the module
  or user changed the full data, `has_been_updated=True` copies this rank's slice back first.

DeepSpeed's per-parameter methods `param.all_gather()` / `param.partition()` call these through
`PARAM_COLLECTIVES`, which conversion (param_conversion.py) hands to each parameter's state: the
parameter class (param_state.py) does not import this module, which is built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.zero.param_state import (
    ZeroParameter,
    ZeroParamState,
    ZeroParamStatus,
    drop_data,
    is_zero_param,
    rank_span,
    set_status,
)

__all__ = ["IN_PLACE_PACK_BYTES", "PARAM_COLLECTIVES", "GatherHandle", "MultiGatherHandle", "compute_device",
           "gather_params", "release_params", "store_partition"]

# gloo gathers: smaller parameters share buffers of up to this size (`_gather_in_place`)
IN_PLACE_PACK_BYTES = 1 << 20


# --- gather / release --------------------------------------------------------------------------------

class GatherHandle:
    """Outstanding gathers of `params`; `wait()` gives them their full data and makes them AVAILABLE.
    `unpack()`, called once the works are done, returns each parameter's full flat data."""

    def __init__(self, params: list[ZeroParameter], works: list[Any],
                 unpack: Callable[[], list[torch.Tensor]]) -> None:
        self.params = params
        self._works = works
        self._unpack: Callable[[], list[torch.Tensor]] | None = unpack
        self.numel = sum(p.zs_state.numel for p in params)

    def wait(self) -> None:
        if self._unpack is None:
            return
        for work in self._works:
            if work is not None:
                work.wait()  # the only call made on a handle: gloo's have no usable future
        for param, full in zip(self.params, self._unpack()):
            # AVAILABLE first: the class it then takes sets `.data` without a `__torch_function__` call
            set_status(param, ZeroParamStatus.AVAILABLE)
            param.data = full.view(param.zs_state.shape)
        self._unpack = None
        self._works = []


def gather_params(params: Iterable[torch.nn.Parameter], async_op: bool = False) -> MultiGatherHandle:
    """Start gathering the NOT_AVAILABLE ones among `params` (one collective per dtype)."""
    todo = sorted({id(p): p for p in params if is_zero_param(p)
                   and p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE}.values(),
                  key=lambda p: p.zs_state.ds_id)
    # One collective per dtype and process group (expert parameters are partitioned over their
    # expert-data-parallel group, [Note: MoE at stage 3]); keys in first-ds_id order, as on every rank.
    by_dtype: dict[tuple[torch.dtype, int], list[ZeroParameter]] = {}
    for param in todo:
        key = (param.zs_state.partition.dtype, id(param.zs_state.group))
        by_dtype.setdefault(key, []).append(param)
    return MultiGatherHandle([handle for group in by_dtype.values() for handle in _gather_same_dtype(group, async_op)])


def compute_device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def _gather_same_dtype(params: list[ZeroParameter], async_op: bool) -> list[GatherHandle]:
    for param in params:
        set_status(param, ZeroParamStatus.INFLIGHT)
    # Partitions may live in host memory (offload_param); the gather runs on the compute device.
    # a cost choice only: the in-place gather is correct on any backend (an all-reduce's bytes on NCCL)
    if comm.prefers_in_place(params[0].zs_state.group):
        return _gather_in_place(params, compute_device(), async_op)
    return [_gather_rank_major(params, compute_device(), async_op)]


def _gather_rank_major(params: list[ZeroParameter], device: torch.device, async_op: bool) -> GatherHandle:
    """One `all_gather_into_tensor` of the partitions end to end; parameter i is then cut out of
    chunk i of every rank's slice (a copy)."""
    state = params[0].zs_state
    local = _local_partitions(params).to(device, non_blocking=True)
    output = torch.empty(local.numel() * state.world_size, dtype=local.dtype, device=device)
    work = comm.all_gather_into_tensor(output, local, group=state.group, async_op=async_op)

    def unpack() -> list[torch.Tensor]:
        rows = output.view(state.world_size, -1)
        full, offset = [], 0
        for param in params:
            size = param.zs_state.partition_numel
            full.append(rows[:, offset:offset + size].reshape(-1)[:param.zs_state.numel])
            offset += size
        return full
    return GatherHandle(params, [work if async_op else None], unpack)


def _gather_in_place(params: list[ZeroParameter], device: torch.device, async_op: bool) -> list[GatherHandle]:
    """gloo ([Note: gloo temporaries] in comm/comm.py): parameters packed in order into buffers of at
    most `IN_PLACE_PACK_BYTES` (a larger parameter alone in its own), one handle each, so a fetch
    waits only for the buffers its module needs, a released parameter keeps at most a small buffer
    alive, and many small parameters (the persistent ones) still travel in few collectives."""
    handles: list[GatherHandle] = []
    run: list[ZeroParameter] = []
    run_bytes = 0
    for param in params:
        nbytes = param.zs_state.padded_numel * param.zs_state.partition.element_size()
        if run and run_bytes + nbytes > IN_PLACE_PACK_BYTES:
            handles.append(_gather_packed(run, device, async_op))
            run, run_bytes = [], 0
        run.append(param)
        run_bytes += nbytes
    return handles + ([_gather_packed(run, device, async_op)] if run else [])


def _gather_packed(params: list[ZeroParameter], device: torch.device, async_op: bool) -> GatherHandle:
    """One buffer, each parameter's padded slot end to end, this rank's partition written at its
    place in each slot and zeros elsewhere, completed by one in-place all-gather: each slot then *is*
    the full parameter (a view), with no concatenation, no copy out and no temporary."""
    buffer = torch.empty(sum(p.zs_state.padded_numel for p in params), dtype=params[0].zs_state.partition.dtype,
                         device=device)
    if len(params) > 1:
        buffer.zero_()
    slots, offset = [], 0
    for param in params:
        state = param.zs_state
        size = state.partition_numel
        start = offset + state.dp_rank * size
        if len(params) == 1:   # a large parameter: zero only the other ranks' chunks
            if start:
                buffer.narrow(0, 0, start).zero_()
            if start + size < buffer.numel():
                buffer.narrow(0, start + size, buffer.numel() - start - size).zero_()
        _read_partition(state, buffer.narrow(0, start, size))
        slots.append(buffer.narrow(0, offset, state.numel))
        offset += state.padded_numel
    work = comm.all_gather_in_place(buffer, group=params[0].zs_state.group, async_op=async_op)
    return GatherHandle(params, [work], lambda: slots)


def _read_partition(state: ZeroParamState, out: torch.Tensor) -> None:
    """Copy this rank's partition into `out`, wherever it lives (read from NVMe when swapped)."""
    if state.swapped is None:
        out.copy_(state.partition)
    elif out.device.type == "cpu":
        state.swapped.swapper.read_into(state.swapped, out)
    else:  # the swapper reads into host memory
        host = torch.empty(out.shape, dtype=out.dtype)
        state.swapped.swapper.read_into(state.swapped, host)
        out.copy_(host)


def _local_partitions(params: list[ZeroParameter]) -> torch.Tensor:
    """This rank's partitions of `params`, end to end (read from NVMe for swapped ones)."""
    states = [p.zs_state for p in params]
    if all(s.swapped is None for s in states):
        return torch.cat([s.partition for s in states]) if len(states) > 1 else states[0].partition
    local = torch.empty(sum(s.partition_numel for s in states), dtype=states[0].partition.dtype)
    offset = 0
    for state in states:
        _read_partition(state, local.narrow(0, offset, state.partition_numel))
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
            drop_data(param)


class _ParamCollectives:
    """`ParamCollectives` (param_state.py) by this module's functions: what `param.all_gather()`
    and `param.partition()` call. Stateless, one instance shared by every parameter."""

    def gather(self, params: list[torch.nn.Parameter]) -> MultiGatherHandle:
        return gather_params(params)

    def release(self, params: list[torch.nn.Parameter], has_been_updated: bool) -> None:
        release_params(params, has_been_updated=has_been_updated)


PARAM_COLLECTIVES = _ParamCollectives()
