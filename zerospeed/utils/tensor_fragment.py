"""DeepSpeed's `safe_get_*` / `safe_set_*` accessors: one parameter's fp32 master, gradient or
optimizer state, whole ("full", a collective: every rank of the data-parallel group must call)
or this rank's partition ("local", ZeRO-3 only, as in DeepSpeed).

The engine links each of its parameters to itself (`link_params`); the optimizer wrapper
of its stage says where the parameter's piece lives:
- stage 0: the master is the parameter (fp32) or its fp32 copy; the gradient is the reduced one;
- stages 1/2: a parameter occupies [offset, offset + numel) of its group's flat buffer, and each
  rank owns one equal partition of that buffer (masters, gradients and moments alike);
- stage 3: each rank owns ceil(numel / W) elements of the parameter at one offset of a sub-group.
A full read rebuilds the parameter from every rank's piece; a full write keeps this rank's piece.
Gradients are read after `backward` and before `step` (the reduced, averaged gradient; None
outside that window). Offloaded optimizer states are not reachable here yet (docs/integrations.md).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.zero.param_state import zero_state

__all__ = [
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
]


# id(param) -> its engine. Weak: a dead engine drops out; parameters are not touched (a reference
# stored on them would make them unpicklable). Lookups below check identity, not just the id.
_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def link_params(params: Iterable[torch.nn.Parameter], engine: Any) -> None:
    for param in params:
        _OWNERS[id(param)] = engine


@dataclasses.dataclass
class _Piece:
    """Where one parameter's elements sit in flat buffers of this rank."""

    master: torch.Tensor        # the flat the fp32 master elements are in
    grad: torch.Tensor | None   # the flat its gradient is in (same offsets)
    state_key: torch.Tensor     # the tensor the optimizer keys its state by
    flat_start: int             # offset of this rank's piece in `master` / `grad` / state tensors
    param_start: int            # offset of this rank's piece in the flattened parameter
    numel: int                  # elements in this rank's piece
    stage: int
    group: Any = None           # the ranks the pieces are spread over (None: the data-parallel group;
                                # an expert parameter's expert-data-parallel group, [Note: MoE param groups])


def _engine_of(param: torch.nn.Parameter) -> Any:
    engine = _OWNERS.get(id(param))
    if engine is None or engine.optimizer is None:
        raise ValueError("safe_get/set_*: this parameter is not trained by a live zerospeed engine "
                         "(or it is frozen: only trainable parameters have masters and gradients)")
    return engine


def _piece(param: torch.nn.Parameter) -> _Piece:
    optimizer = _engine_of(param).optimizer
    if getattr(optimizer, "offload", None) is not None:
        raise NotImplementedError("safe_get/set_* with offload_optimizer are not implemented in zerospeed yet")
    if hasattr(optimizer, "_slots"):
        return _stage3_piece(optimizer, param)
    if hasattr(optimizer, "groups") and hasattr(optimizer, "partition_gradients"):
        return _stage12_piece(optimizer, param)
    return _stage0_piece(optimizer, param)


def _stage0_piece(optimizer: Any, param: torch.nn.Parameter) -> _Piece:
    for index, (lp, master) in enumerate(optimizer.params_and_masters()):
        if lp is param:
            grad = optimizer._gradient(index)  # the reduced gradient (zeros before any backward)
            return _Piece(master.view(-1), grad.view(-1), master, 0, 0, param.numel(), 0)
    raise ValueError("safe_get/set_*: parameter not found in the optimizer (frozen?)")


def _stage12_piece(optimizer: Any, param: torch.nn.Parameter) -> _Piece:
    for group in optimizer.groups:
        for index, candidate in enumerate(group.params):
            if candidate is not param:
                continue
            offset, numel = group.layout.param_offsets[index], param.numel()
            part_start = group.layout.partition_start(group.dp_rank)
            lo, hi = max(offset, part_start), min(offset + numel, part_start + group.layout.partition_numel)
            return _Piece(group.master, group.partition_grad, group.master, max(0, lo - part_start),
                          max(0, lo - offset), max(0, hi - lo), 2 if optimizer.partition_gradients else 1,
                          group.process_group)
    raise ValueError("safe_get/set_*: parameter not found in the optimizer (frozen?)")


def _stage3_piece(optimizer: Any, param: torch.nn.Parameter) -> _Piece:
    slot = optimizer._slots.get(id(param))
    if slot is None:
        raise ValueError("safe_get/set_*: parameter not found in the optimizer (frozen?)")
    master = optimizer.fp32_flat[slot.sub_group]
    state = zero_state(param)
    size = state.partition_numel
    group = getattr(param, "ds_process_group", None)   # an expert's: its expert-data-parallel group
    start = (optimizer.dp_rank if group is None else comm.get_rank(group)) * size
    numel = max(0, min(size, state.numel - start))
    return _Piece(master.data, optimizer.grad_flat[slot.sub_group], master, slot.offset, start, numel, 3, group)


def _group_of(param: torch.nn.Parameter, piece: _Piece) -> Any:
    return _engine_of(param).dp_group if piece.group is None else piece.group


def _assemble(param: torch.nn.Parameter, piece: _Piece, flat: torch.Tensor) -> torch.Tensor:
    """The whole parameter from every rank's piece (a sum: each element is owned by one rank)."""
    full = torch.zeros(zero_state(param).numel if piece.stage == 3 else param.numel(), dtype=torch.float32,
                       device=flat.device)
    if piece.numel:
        full.narrow(0, piece.param_start, piece.numel).copy_(flat.narrow(0, piece.flat_start, piece.numel))
    if piece.stage > 0:
        comm.all_reduce(full, group=_group_of(param, piece))
    return full.view(zero_state(param).shape if piece.stage == 3 else param.shape)


def _scatter(piece: _Piece, flat: torch.Tensor, value: torch.Tensor) -> None:
    if piece.numel:
        mine = value.detach().reshape(-1).narrow(0, piece.param_start, piece.numel)
        flat.narrow(0, piece.flat_start, piece.numel).copy_(mine)


def _loss_scale(param: torch.nn.Parameter) -> float:
    return float(getattr(_engine_of(param).optimizer, "loss_scale", 1.0) or 1.0)


def _state_flat(param: torch.nn.Parameter, piece: _Piece, key: str) -> torch.Tensor:
    optimizer = _engine_of(param).optimizer.optimizer
    state = optimizer.state.get(piece.state_key, {})
    if key not in state or not torch.is_tensor(state[key]):
        raise KeyError(f"optimizer state {key!r} not found for this parameter (known: {sorted(state)})")
    return state[key].view(-1)


@torch.no_grad()
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    piece = _piece(param)
    return _assemble(param, piece, piece.master)


@torch.no_grad()
def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    piece = _piece(param)
    _scatter(piece, piece.master, value)


@torch.no_grad()
def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    piece = _piece(param)
    if piece.grad is None:
        return None
    finish = getattr(_engine_of(param).optimizer, "_finish_reductions", None)
    if finish is not None:
        finish()
    return _assemble(param, piece, piece.grad.float()) / _loss_scale(param)


@torch.no_grad()
def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    piece = _piece(param)
    if piece.grad is None:
        raise ValueError("safe_set_full_grad: no gradient buffer for this parameter (call it between backward and step)")
    _scatter(piece, piece.grad, value * _loss_scale(param))


@torch.no_grad()
def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    piece = _piece(param)
    return _assemble(param, piece, _state_flat(param, piece, optim_state_key))


@torch.no_grad()
def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    piece = _piece(param)
    _scatter(piece, _state_flat(param, piece, optim_state_key), value)


def _local(param: torch.nn.Parameter) -> _Piece:
    piece = _piece(param)
    if piece.stage != 3:
        raise ValueError("safe_get/set_local_* are for ZeRO stage 3 (as in DeepSpeed); use safe_get/set_full_*")
    return piece


def _local_numel(param: torch.nn.Parameter) -> int:
    """This rank's partition of a ZeRO-3 parameter (the `safe_*_local_*` functions are stage 3's)."""
    return zero_state(param).partition_numel


def _grad_flat(piece: _Piece) -> torch.Tensor:
    if piece.grad is None:
        raise ValueError("safe_get/set_local_grad: no gradient partition (called outside backward / step?)")
    return piece.grad


@torch.no_grad()
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    piece = _local(param)
    return piece.master.narrow(0, piece.flat_start, _local_numel(param)).clone()


@torch.no_grad()
def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    piece = _local(param)
    piece.master.narrow(0, piece.flat_start, _local_numel(param)).copy_(value.reshape(-1))


@torch.no_grad()
def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    piece = _local(param)
    return _grad_flat(piece).narrow(0, piece.flat_start, _local_numel(param)).float() / _loss_scale(param)


@torch.no_grad()
def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    piece = _local(param)
    _grad_flat(piece).narrow(0, piece.flat_start, _local_numel(param)).copy_(value.reshape(-1) * _loss_scale(param))


@torch.no_grad()
def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    piece = _local(param)
    return _state_flat(param, piece, optim_state_key).narrow(0, piece.flat_start, _local_numel(param)).clone()


@torch.no_grad()
def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    piece = _local(param)
    _state_flat(param, piece, optim_state_key).narrow(0, piece.flat_start, _local_numel(param)).copy_(
        value.reshape(-1))
