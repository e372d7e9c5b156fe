"""Full weights from tensor-parallel pieces, and pieces from full weights.

`consolidated_state_dict` all-gathers every split parameter over the tp group and reassembles it
from its `TPShard` (fused parts put back in order), so the result has the unsharded model's keys
and shapes: what `save_16bit_model` writes and Hugging Face loads. It is collective: every rank of
the tp group must call it (HF's own TP export deadlocked when rank 0 alone gathered, tf PR#48569).
`shard_state_dict` cuts a full state dict down to this rank's pieces, which is how a checkpoint
saved at one tp size loads at another.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.runtime.tensor_parallel.layers import TPShard, all_gather_pieces, shard_of

__all__ = ["consolidated_state_dict", "gather_shards", "shard_state_dict", "split_params"]


def gather_shards(piece: torch.Tensor, shard: TPShard, group: Any) -> torch.Tensor:
    """The full tensor from every tp rank's ``piece`` (collective over ``group``)."""
    pieces = all_gather_pieces(piece, group)
    per_rank = [p.chunk(shard.fused_parts, dim=shard.dim) for p in pieces.unbind(0)]
    parts = [torch.cat([chunks[part] for chunks in per_rank], dim=shard.dim) for part in range(shard.fused_parts)]
    return torch.cat(parts, dim=shard.dim)


def split_params(module: torch.nn.Module) -> dict[str, TPShard]:
    """State-dict name -> shard of every split parameter of ``module``."""
    return {name: param.ds_tp_shard for name, param in module.named_parameters()  # type: ignore[attr-defined]
            if getattr(param, "ds_tp_shard", None) is not None}


def consolidated_state_dict(module: torch.nn.Module, group: Any, state: dict[str, Any] | None = None,
                            exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """``module``'s state dict (or ``state``, keyed the same) with every split parameter made whole."""
    state = module.state_dict() if state is None else state
    split = split_params(module)
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    full: dict[str, Any] = {}
    for name, value in state.items():
        if exclude_frozen_parameters and name in frozen:
            continue
        full[name] = gather_shards(value, split[name], group) if name in split else value
    return full


def shard_state_dict(module: torch.nn.Module, full: dict[str, Any]) -> dict[str, Any]:
    """A full (unsharded) state dict cut to this rank's pieces of ``module``'s split parameters."""
    split = split_params(module)
    return {name: shard_of(value, split[name]) if name in split and torch.is_tensor(value) else value
            for name, value in full.items()}
