"""The optimizer side of a checkpoint: what a tag directory holds, and the pieces of the one load rule.

The rule itself is `WeightFiles.load_optimizer` (weight_files.py): the saved layout (stage and dp
size, read from the files by `discover`) equal to this run's optimizer's `checkpoint_layout()`,
each rank reads only its own optim file (or, for replicated state, the model file's `optimizer`
entry: `own_state`) and hands it to the wrapper's `load_state_dict`, as DeepSpeed does. Otherwise
(another dp size, another stage, stage 0 saved in another precision: `stage0_precision_changed`)
every rank reads the saved state into the full layout (`export_full_state`, [Note: full layout]
in full_state.py) and the wrapper's `load_full_state` cuts from it the state dict it expects: the
fp32 masters and moments come back exactly, whatever the partitioning was.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any


from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.checkpoint.deepspeed_format import stage0_for_deepspeed, stage0_from_deepspeed
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.full_state import (FullOptimizerState, export_stage0, export_zero3, export_zero12,
                                             merge_param_shapes)
from zerospeed.checkpoint.layout import find_model_files, find_optim_files
from zerospeed.checkpoint.manifest import load_file, verify_files
from zerospeed.checkpoint.contract import CheckpointLayout

__all__ = ["SavedLayout", "discover", "export_full_state", "own_state", "restore_weights", "stage0_optimizer_entry",
           "stage0_precision_changed", "stage0_wrapper_state"]


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What a tag directory holds: its stage, dp size and files (dp-rank order)."""

    tag_dir: str
    zero_stage: int
    dp_world_size: int
    model_files: list[str]
    optim_files: list[str]

    @property
    def layout(self) -> CheckpointLayout:
        """Stage-0 state is replicated (in the model file) whatever else the directory holds."""
        return CheckpointLayout(self.zero_stage, self.dp_world_size if self.zero_stage else 1)


def discover(tag_dir: str, bf16_first: bool, mp_rank: int = 0) -> SavedLayout:
    verify_files(tag_dir, checksum=False)   # every listed file present, at its size (checksums: on read)
    model_files = find_model_files(tag_dir)
    if not model_files:
        raise FileNotFoundError(f"no *_model_states.pt file in checkpoint directory {tag_dir}")
    optim_files = find_optim_files(tag_dir, bf16_first, mp_rank)
    if not optim_files:
        return SavedLayout(tag_dir, 0, 1, model_files, [])
    first = load_file(optim_files[0], mmap=True)[C.OPTIMIZER_STATE_DICT]
    stage = int(first.get(C.ZERO_STAGE, 0))
    counts = first[C.PARTITION_COUNT]
    dp_world_size = int(max(counts) if isinstance(counts, list) else counts)
    if len(optim_files) != dp_world_size:
        raise ValueError(f"checkpoint {tag_dir} has {len(optim_files)} optim files, expected {dp_world_size} "
                         f"(its partition_count): a rank's file is missing")
    return SavedLayout(tag_dir, stage, dp_world_size, model_files, optim_files)


# --- the stage-0 entry of the model-states file ---------------------------------------------------
def stage0_optimizer_entry(ctx: CheckpointContext) -> dict[str, Any] | None:
    """The model file's `optimizer` in DeepSpeed's shape (deepspeed_format.py), with the param names
    that make it reshardable; None where the optimizer state is in the optim files."""
    state = ctx.optimizer.model_file_optimizer_state(ctx.param_names)
    if state is None:
        return None
    # masters exist for trainable parameters only: a group's frozen parameters have no fp32 copy
    return stage0_for_deepspeed(state, [sum(flags) for flags in state["trainable"]])


def stage0_wrapper_state(ctx: CheckpointContext, entry: dict[str, Any]) -> dict[str, Any]:
    """A saved stage-0 entry (DeepSpeed's or ours) as a stage-0 wrapper state, named by param.
    DeepSpeed's entry has no names: where this run's optimizer keeps one tensor per parameter, its
    order names it (same model, same order); elsewhere loading it needs the names and raises in
    export_stage0."""
    replicated = ctx.optimizer.replicated_state(ctx.param_names)
    if replicated is None:
        return stage0_from_deepspeed(entry, None, 0.0)
    state = stage0_from_deepspeed(entry, replicated.params, replicated.clip_grad)
    if "param_names" not in state:
        state["param_names"], state["trainable"] = replicated.names, replicated.trainable
    return state


# --- loading ----------------------------------------------------------------------------------------
def own_state(saved: SavedLayout, model_state: dict[str, Any], dp_rank: int) -> dict[str, Any]:
    """This rank's state in a directory of its own layout: its optim file, or the model file's entry."""
    if saved.zero_stage == 0:
        return model_state[C.OPTIMIZER]
    verify_files(saved.tag_dir, [os.path.basename(saved.optim_files[dp_rank])])
    return load_file(saved.optim_files[dp_rank])[C.OPTIMIZER_STATE_DICT]


def stage0_precision_changed(ctx: CheckpointContext, saved: SavedLayout, model_state: dict[str, Any]) -> bool:
    """A replicated entry saved with fp32 masters and loaded without (or back): through the full
    representation, which takes the masters from the saved fp32 module weights."""
    replicated = ctx.optimizer.replicated_state(ctx.param_names)
    if saved.zero_stage != 0 or replicated is None:
        return False
    return ("fp32_groups" in (model_state[C.OPTIMIZER] or {})) != replicated.fp32_masters


def export_full_state(saved: SavedLayout, model_state: dict[str, Any]) -> FullOptimizerState:
    if saved.zero_stage == 0:
        return export_stage0(stage0_from_deepspeed(model_state[C.OPTIMIZER], None, 0.0), model_state[C.MODULE])
    verify_files(saved.tag_dir, [os.path.basename(f) for f in saved.optim_files])
    naming = None
    if model_state.get(moe_reshard.EP_SIZES_KEY):   # [Note: MoE stage-3 reshard]
        names = list(merge_param_shapes(model_state[C.PARAM_SHAPES]))
        naming = moe_reshard.saved_naming(model_state, names, saved.dp_world_size, saved.tag_dir)
    if saved.zero_stage in (1, 2):
        return export_zero12(_each_optim_state(saved), model_state[C.PARAM_SHAPES], naming)
    return export_zero3(_each_optim_state(saved), model_state[C.PARAM_SHAPES], saved.dp_world_size, naming)


def _each_optim_state(saved: SavedLayout) -> Iterator[dict[str, Any]]:
    for path in saved.optim_files:
        yield load_file(path, mmap=True)[C.OPTIMIZER_STATE_DICT]


def restore_weights(ctx: CheckpointContext, saved: SavedLayout, model_state: dict[str, Any],
                    full_state: Callable[[], FullOptimizerState] | None = None) -> None:
    """No optimizer state wanted: the weights come from the module file, except when either side
    keeps them in the optim files (ZeRO-3: its module file holds empty tensors): then from the fp32
    masters of the optim files (DeepSpeed rebuilds them with zero_to_fp32), read by `full_state`
    (the file set's: AutoTP joins every tp rank's pieces), by default this mp rank's files. Moments
    and loss scale stay fresh."""
    if saved.zero_stage >= 3 or ctx.optimizer.weights_in_optimizer_files:
        full = export_full_state(saved, model_state) if full_state is None else full_state()
        masters = FullOptimizerState(fp32=full.fp32)
        ctx.optimizer.load_full_state(masters, ctx.param_names, load_optimizer_states=False)
        return
    # DeepSpeed's `_restore_from_bit16_weights`: fp32 masters re-derived from the module weights
    ctx.optimizer.refresh_fp32_params()
