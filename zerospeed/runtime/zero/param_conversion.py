"""Conversion: a full parameter becomes a ZeRO-3 parameter holding this rank's partition.

Every rank converts the same parameters in the same order (`zero.Init` walks modules as they are
built; the engine walks the model), so the `ds_id`s it hands out agree across ranks. Kept apart
from partition_parameters.py so that `zero.Init` (zero_init.py) can convert without importing it
(it re-exports `Init` at DeepSpeed's path). Each converted parameter's state is handed the gather
primitives its `all_gather()` / `partition()` methods call (param_gather.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.zero.param_gather import PARAM_COLLECTIVES
from zerospeed.runtime.zero.param_state import (
    ZeroParameter,
    ZeroParamState,
    attach_state,
    drop_data,
    is_zero_param,
    partition_numel,
    rank_span,
)

__all__ = ["convert_to_zero_param", "drop_data"]

_ds_ids = itertools.count()  # unique across every model this process builds, same order on every rank


@torch.no_grad()
def convert_to_zero_param(param: torch.nn.Parameter, group: Any = None, name: str = "",
                          persist: bool = False, broadcast: bool = True) -> ZeroParameter:
    """Partition a full parameter in place: keep this rank's slice, drop the rest unless `persist`."""
    if is_zero_param(param):
        return param
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
                           name=name, persist=persist, collectives=PARAM_COLLECTIVES)
    zparam = attach_state(param, state)
    if not persist:
        drop_data(zparam)
    return zparam

