"""AutoTP checkpoints in DeepSpeed's layout, and loading them at another tp size.

[Note: AutoTP checkpoint layout]
As DeepSpeed with an mpu, the model-parallel rank is the tp rank: data-parallel rank 0 of each tp
rank writes ``mp_rank_{tp:02d}_model_states.pt`` (its pieces of the split parameters, the
replicated ones whole, ``mp_world_size`` = tp), and every rank writes
``zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` at ZeRO 1-2. The model file also records how
each split parameter was cut (``autotp_shards``: name -> [dim, fused parts]), so a run at another
tp size (or without TP) rebuilds the full weights from all ``mp_rank_*`` files and takes its own
pieces. DeepSpeed needs a universal-checkpoint conversion for that (DS#7320, PR#8474). The optimizer
state reshards the same way ([Note: AutoTP optimizer resharding] in optimizer_reshard.py).

At ZeRO-3 every rank writes ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt`` (module tensors
are placeholders, as DeepSpeed's) and its optim file, whose flat partitions hold the weights. Such a
checkpoint loads at any tp size too: its module files are left as they are (placeholders and
buffers) and the weights come with the optimizer state, joined from every tp rank's optim files
([Note: AutoTP optimizer resharding]); a universal folder of it (`ds_to_universal`, then
`load_universal`) goes the same way.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import torch

from zerospeed.checkpoint.constants import TP_SHARDS_KEY
from zerospeed.checkpoint.tp_pieces import join_pieces, saved_tp_size
from zerospeed.runtime.tensor_parallel.state_dict import shard_state_dict, split_params

__all__ = ["TP_SHARDS_KEY", "join_pieces", "merge_tp_module_states", "saved_shard_record", "saved_tp_size",
           "shard_record", "tp_module_state"]

def shard_record(module: torch.nn.Module) -> dict[str, list[int]]:
    """name -> [dim, fused parts] of every split parameter (plain types, for the model file)."""
    return {name: [shard.dim, shard.fused_parts] for name, shard in split_params(module).items()}


def merge_tp_module_states(states: list[dict[str, Any]], record: dict[str, list[int]]) -> dict[str, Any]:
    """The full module state dict from every tp rank's module state (in tp-rank order)."""
    full = dict(states[0])
    for name, (dim, fused_parts) in record.items():
        full[name] = join_pieces([state[name] for state in states], dim, fused_parts)
    return full


def saved_shard_record(tag_dir: str, model_state: dict[str, Any]) -> dict[str, list[int]]:
    """How the checkpoint's split parameters were cut (nothing is split in a checkpoint saved without TP)."""
    saved_tp = saved_tp_size(model_state)
    record = model_state.get(TP_SHARDS_KEY)
    if record is None and saved_tp > 1:
        raise ValueError(f"checkpoint {tag_dir} (tp size {saved_tp}) does not say how its parameters were split "
                         f"('{TP_SHARDS_KEY}'); it loads only at tp size {saved_tp}")
    return record or {}


def tp_module_state(module: torch.nn.Module, tag_dir: str, model_state: dict[str, Any], current_tp: int,
                    load: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The module state this rank loads: its own file's when the tp size is unchanged, else cut
    from the full weights of every ``mp_rank_*`` file ([Note: AutoTP checkpoint layout])."""
    saved_tp = saved_tp_size(model_state)
    if saved_tp == current_tp:
        return model_state["module"]
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if len(files) != saved_tp:
        raise ValueError(f"checkpoint {tag_dir} was saved at tp size {saved_tp} but holds {len(files)} "
                         "mp_rank_*_model_states.pt files (resharding needs ZeRO stage 0-2 files of every tp rank)")
    record = saved_shard_record(tag_dir, model_state)
    full = merge_tp_module_states([load(path)["module"] for path in files], record)
    return shard_state_dict(module, full)

