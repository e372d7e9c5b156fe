"""Tensor-parallel pieces of a checkpoint joined into full tensors (AutoTP's `autotp_shards` record).

An AutoTP checkpoint keeps, per tp rank, that rank's piece of every split parameter, and its
model file records how each was cut: name -> [dim, fused parts] ([Note: AutoTP checkpoint layout]
in runtime/tensor_parallel/checkpoint.py). A fused parameter (q, k, v stacked) is split part by
part, so the full tensor is rebuilt one fused part at a time. Pure tensor code: the direct tp
reshard (runtime/tensor_parallel/optimizer_reshard.py) and the universal converter
(universal/convert.py) both join through it.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint.full_state import FullOptimizerState

__all__ = ["full_shape", "join_pieces", "join_tp_states", "saved_tp_size"]


def saved_tp_size(model_state: dict[str, Any]) -> int:
    """The tp size a model-states file was written at (DeepSpeed's `mp_world_size`)."""
    return int(model_state.get("mp_world_size") or 1)


def join_pieces(pieces: list[torch.Tensor], dim: int, fused_parts: int) -> torch.Tensor:
    """The full tensor from every tp rank's piece (in tp-rank order): each fused part is split on its own."""
    per_rank = [piece.chunk(fused_parts, dim=dim) for piece in pieces]
    return torch.cat([torch.cat([chunks[part] for chunks in per_rank], dim=dim) for part in range(fused_parts)], dim=dim)


def full_shape(piece_shape: torch.Size, split: list[int] | None, tp_size: int) -> torch.Size:
    """The full shape of a parameter whose tp piece has `piece_shape` (`split`: its record entry)."""
    if split is None:
        return piece_shape
    shape = list(piece_shape)
    shape[split[0]] *= tp_size
    return torch.Size(shape)


def join_tp_states(per_rank: list[FullOptimizerState], record: dict[str, list[int]]) -> FullOptimizerState:
    """Every tp rank's full-layout state (tp-rank order) joined: split masters and per-element
    moments along their split dimension; scalars (the step) and hyperparameters, equal on every tp
    rank, from tp rank 0."""
    first = per_rank[0]
    full = FullOptimizerState(scalars=first.scalars, param_groups=first.param_groups,
                              loss_scaler=first.loss_scaler, overflow=any(s.overflow for s in per_rank))
    for name, master in first.fp32.items():
        split = record.get(name)
        full.fp32[name] = master if split is None else join_pieces([s.fp32[name] for s in per_rank], *split)
        for key, moment in first.moments.get(name, {}).items():
            pieces = [s.moments[name][key] for s in per_rank]
            full.moments.setdefault(name, {})[key] = moment if split is None else join_pieces(pieces, *split)
    return full
