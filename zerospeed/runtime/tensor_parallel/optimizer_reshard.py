"""The optimizer state of an AutoTP checkpoint loaded at another tp size (or without TP).

[Note: AutoTP optimizer resharding]
Each tp rank's files hold its pieces: ``mp_rank_{tp}_model_states.pt`` and, at ZeRO 1-2,
``zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt`` (at ZeRO-3 the model-states files are per dp rank
too, ``zero_pp_rank_{dp}_mp_rank_{tp}_model_states.pt``). Loading at tp size T' reads every saved tp
rank's optimizer side into the full layout of its pieces (checkpoint/full_state.py: fp32 masters
and per-element moments by parameter name, whatever the ZeRO stage and dp size were), joins the
pieces of each split parameter along its split dimension (the model file's ``autotp_shards``
record: dim and fused parts, as for the weights), and cuts this rank's piece for T' with the same
rule the current model was split by. Masters and moments (Adam's exp_avg, exp_avg_sq) are per
element, so the cut is exact; scalar state (Adam's step) and hyperparameters are equal on every
tp rank and come from tp rank 0. The result goes through the ordinary import
(the wrapper's ``load_full_state``), so any ZeRO stage 0-3 and dp size of the loading run works,
from a checkpoint of any stage 0-3: at ZeRO-3 the saved masters are the weights (the model files
hold placeholders), so the loading run's weights come from this full state too.

DeepSpeed 0.19.8 reaches the same end in two steps: ``ds_to_universal.py`` converts the checkpoint
into per-parameter files and ``"checkpoint": {"load_universal": true}`` loads them at the new
size. zerospeed loads the saved checkpoint directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.layout import model_states_name
from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state
from zerospeed.checkpoint.tp_pieces import join_tp_states
from zerospeed.runtime.tensor_parallel.checkpoint import saved_shard_record, saved_tp_size
from zerospeed.runtime.tensor_parallel.layers import shard_of
from zerospeed.runtime.tensor_parallel.state_dict import split_params

__all__ = ["cut_tp_pieces", "tp_resharded_optimizer_state"]


def tp_resharded_optimizer_state(module: torch.nn.Module, tag_dir: str, model_state: dict[str, Any], bf16: bool,
                                 load: Callable[[str], dict[str, Any]]) -> FullOptimizerState:
    """This rank's optimizer state, by parameter name, cut for the tp split of `module` from a
    checkpoint saved at another tp size ([Note: AutoTP optimizer resharding]); `bf16`: look for
    this run's `bf16_` optim files first."""
    saved_tp = saved_tp_size(model_state)
    record = saved_shard_record(tag_dir, model_state)
    per_rank = [_export_tp_rank(tag_dir, mp_rank, bf16, load) for mp_rank in range(saved_tp)]
    full = join_tp_states(per_rank, record)
    return cut_tp_pieces(full, module)


def _export_tp_rank(tag_dir: str, mp_rank: int, bf16: bool, load: Callable[[str], dict[str, Any]]) -> FullOptimizerState:
    """Tp rank `mp_rank`'s state in the full layout of its pieces, from its optim files and its dp
    rank 0 model-states file (at ZeRO-3 one per dp rank, alike in what is read here)."""
    saved = discover(tag_dir, bf16_first=bf16, mp_rank=mp_rank)
    path = os.path.join(tag_dir, model_states_name(saved.zero_stage, 0, mp_rank))
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {tag_dir}: {os.path.basename(path)} is missing (resharding the optimizer "
                                "state to another tp size needs every tp rank's files)")
    return export_full_state(saved, load(path))


def cut_tp_pieces(full: FullOptimizerState, module: torch.nn.Module) -> FullOptimizerState:
    split = split_params(module)

    def mine(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_of(tensor, split[name]) if name in split else tensor

    full.fp32 = {name: mine(name, value) for name, value in full.fp32.items()}
    full.moments = {name: {key: mine(name, value) for key, value in by_key.items()}
                    for name, by_key in full.moments.items()}
    return full
