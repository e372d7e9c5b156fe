"""`WeightFiles`: where a checkpoint keeps the module's weights, the part of the one save / load sequence a feature contributes.

[Note: weight files]
The engine's `save_checkpoint` and `load_checkpoint` (runtime/engine_checkpointer.py) are one
sequence for every run. What differs between features is which files hold the module's weights
and how they come back, and each feature says so by the `WeightFiles` it hands the sequence, never
by a branch in it:

* `WeightFiles` (this file): the model-states file's `module` entry; with MoE layers each expert
  in a file of its own ([Note: MoE checkpoint layout] in moe_checkpoint.py);
* `ShardedWeightFiles` (runtime/tensor_parallel/checkpoint.py): the same files per tp rank and the
  shard record that lets them load at another tp size ([Note: AutoTP checkpoint layout]);
* `PipelineLayerFiles` (runtime/pipe/checkpointing.py): one file per layer by global layer index,
  the model-states file of each stage holding `module: None`.

Save: `write` writes this rank's weight files and fills the model-states dict where this rank
writes one. Load: `model_file` names the model-states file this rank reads, `saved_layout` what the
directory holds, `load_module` puts the weights into the module, and `load_optimizer` applies the
one rule to the optimizer state: the same layout, each rank reads its own file; another one
(`layout_changed` says what the optimizer cannot see), one read into the full layout by
`full_state` ([Note: full layout] in full_state.py), then `load_full_state`. A feature that cannot
reshard refuses in `full_state`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_checkpoint
from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.layout import find_model_files, model_states_name
from zerospeed.checkpoint.model_states import to_plain
from zerospeed.checkpoint.reader import CheckpointReader
from zerospeed.checkpoint.zero_checkpoint import (SavedLayout, discover, export_full_state, own_state, restore_weights,
                                                  stage0_optimizer_entry, stage0_precision_changed, stage0_wrapper_state)

__all__ = ["WeightFiles", "load_module_state"]


class WeightFiles:
    """[Note: weight files]: the weights in the model-states file, MoE experts in their own files.
    `bf16`: this run writes `bf16_` optim files (a load looks for those first)."""

    def __init__(self, bf16: bool) -> None:
        self.bf16 = bf16

    def write(self, ctx: CheckpointContext, transaction: Any, model_states: dict[str, Any] | None,
              exclude_frozen: bool) -> None:
        """Every rank: its weight files beside the model-states file (`model_states`: the dict this
        rank is about to write, None where another rank writes it)."""
        if not ctx.has_moe_layers:
            return
        if model_states is not None:
            moe_checkpoint.strip_expert_states(ctx, model_states, C.MODULE)
        optimizer_entry = moe_checkpoint.stage0_optimizer_file_entry(ctx, stage0_optimizer_entry(ctx))
        moe_checkpoint.save_moe_files(ctx, transaction, to_plain(optimizer_entry))

    def model_file(self, ctx: CheckpointContext, reader: CheckpointReader) -> str:
        """This rank's model-states file: its mp rank's, mp_rank_00 when the tp size changed; at
        ZeRO-3 its dp rank's, or dp rank 0's when saved on fewer dp ranks than now, or mp rank 0's
        when saved on fewer tp ranks (the file set then reads every tp rank's files)."""
        tag_dir = reader.tag_dir
        names = [os.path.basename(f) for f in find_model_files(tag_dir)]
        if not names:
            raise FileNotFoundError(f"no *_model_states.pt file in checkpoint directory {tag_dir}")
        for plain in (model_states_name(0, mp_rank=ctx.mp_rank), model_states_name(0)):
            if plain in names:
                return os.path.join(tag_dir, plain)
        for dp_rank, mp_rank in ((ctx.dp_rank, ctx.mp_rank), (0, ctx.mp_rank)):
            if model_states_name(3, dp_rank, mp_rank) in names:
                return os.path.join(tag_dir, model_states_name(3, dp_rank, mp_rank))
        return os.path.join(tag_dir, model_states_name(3, 0, 0))

    def saved_layout(self, ctx: CheckpointContext, reader: CheckpointReader, model_state: dict[str, Any]) -> SavedLayout:
        """What the tag directory holds for this rank's mp rank (its stage, dp size, files)."""
        return discover(reader.tag_dir, bf16_first=self.bf16, mp_rank=ctx.mp_rank)

    def load_module(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                    model_state: dict[str, Any], strict: bool, custom_load_fn: Any) -> None:
        module_state = model_state[C.MODULE]
        if ctx.has_moe_layers:   # at stage 3 the weights live in the optim files; [Note: MoE checkpoint layout]
            moe_checkpoint.check_stage_crossing(ctx, saved.zero_stage, reader.tag_dir, model_state)
            module_state = moe_checkpoint.merge_expert_states(ctx, reader.tag_dir, module_state, reader.load)
        load_module_state(ctx.module, module_state, strict, custom_load_fn)

    def load_optimizer(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                       model_state: dict[str, Any], load_optimizer_states: bool) -> None:
        """This rank's optimizer state by the one rule: the same layout, its own file and the
        wrapper's `load_state_dict`; another layout, one read into the full representation
        (`full_state`), then the wrapper's `load_full_state`. Without optimizer states, only what
        the weights need (`restore_weights`)."""
        optimizer = ctx.optimizer
        if load_optimizer_states and self.layout_changed(ctx, saved, model_state):
            full = self.full_state(ctx, reader, saved, model_state)
            optimizer.load_full_state(full, ctx.param_names, load_optimizer_states=True)
            return
        if load_optimizer_states and self.load_own_optimizer_state(ctx, reader, saved):
            return
        if saved.zero_stage == 0 and model_state.get(C.OPTIMIZER) is not None:
            model_state = {**model_state, C.OPTIMIZER: stage0_wrapper_state(ctx, model_state[C.OPTIMIZER])}
        if not load_optimizer_states:
            restore_weights(ctx, saved, model_state, lambda: self.full_state(ctx, reader, saved, model_state))
            return
        if saved.layout == optimizer.checkpoint_layout() and not stage0_precision_changed(ctx, saved, model_state):
            optimizer.load_state_dict(own_state(saved, model_state, ctx.dp_rank), load_optimizer_states=True)
            return
        optimizer.load_full_state(self.full_state(ctx, reader, saved, model_state), ctx.param_names,
                                  load_optimizer_states=True)

    def layout_changed(self, ctx: CheckpointContext, saved: SavedLayout, model_state: dict[str, Any]) -> bool:
        """A layout change that the optimizer's own layout does not show: MoE's expert-parallel
        sizes at stages 0-2 ([Note: MoE stage-1/2 reshard]; raises where they cannot reshard);
        AutoTP's tp size (`ShardedWeightFiles`). Asked only when optimizer states are loaded."""
        if not ctx.has_moe_layers or saved.zero_stage == 3:   # stage 3 reshards experts on its own
            return False
        return moe_checkpoint.check_optimizer_topology(ctx, saved.zero_stage, saved.tag_dir, model_state)

    def load_own_optimizer_state(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout) -> bool:
        """Own optimizer state kept outside the optim and model-states files: MoE's per-ep-rank files
        of replicated (stage-0) state ([Note: MoE checkpoint layout]). True when it was loaded."""
        if not (ctx.has_moe_layers and saved.zero_stage == 0 and moe_checkpoint.loads_moe_optimizer_files(ctx)):
            return False
        moe_checkpoint.load_moe_optimizer(ctx, saved.tag_dir, reader.load)
        return True

    def full_state(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                   model_state: dict[str, Any]) -> FullOptimizerState:
        """The saved optimizer state in the full layout, for a load at another layout."""
        return export_full_state(saved, model_state)

    def universal_model_file(self, ctx: CheckpointContext, reader: CheckpointReader) -> str:
        """The model-states file of a universal folder this rank reads (counters, scheduler, buffers)."""
        return self.model_file(ctx, reader)

    @torch.no_grad()
    def load_universal_module(self, ctx: CheckpointContext, reader: CheckpointReader,
                              model_state: dict[str, Any]) -> None:
        """What of the module a universal folder's `zero/` files do not hold: persistent buffers,
        from the model-states file (DeepSpeed leaves them at their initial values)."""
        buffers = dict(ctx.module.named_buffers())
        for name, value in (model_state.get(C.MODULE) or {}).items():
            if name in buffers and torch.is_tensor(value) and value.shape == buffers[name].shape:
                buffers[name].copy_(value)

    def universal_shape(self, name: str, param: torch.nn.Parameter) -> torch.Size:
        """The shape parameter `name` has in a universal folder (whole; this run may hold a piece)."""
        return torch.Size(getattr(param, "ds_shape", param.shape))

    def own_universal_state(self, ctx: CheckpointContext, full: FullOptimizerState) -> FullOptimizerState:
        """The state read from a universal folder cut to what this rank's parameters hold
        (AutoTP: its tp pieces); the optimizer's `load_full_state` partitions it further."""
        return full


def load_module_state(module: torch.nn.Module, module_state: dict[str, Any], strict: bool, custom_load_fn: Any) -> None:
    """`module_state` into `module`, leaving out the entries whose weights come from the optim files."""
    if custom_load_fn is not None:
        custom_load_fn(src=module_state, dst=module)
        return
    from_optimizer = _partitioned_names(module, module_state)
    kept = {name: tensor for name, tensor in module_state.items() if name not in from_optimizer}
    missing, unexpected = module.load_state_dict(kept, strict=False)
    missing = [name for name in missing if name not in from_optimizer]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: "
                           f"missing keys {missing}, unexpected keys {unexpected}")


def _partitioned_names(module: torch.nn.Module, saved: dict[str, Any]) -> set[str]:
    """Entries whose weights come from the optim files, not the module file: this run's partitioned
    ZeRO-3 params (their data is a (0,) placeholder; `ds_id` marks them, as in model_states.py), and
    the (0,) placeholders of a stage-3 file loaded at another stage."""
    own = module.state_dict(keep_vars=True)
    names = set()
    for name, tensor in saved.items():
        mine = own.get(name)
        if mine is not None and ((mine.numel() == 0 and hasattr(mine, "ds_id"))
                                 or (tensor.numel() == 0 and mine.numel() != 0)):
            names.add(name)
    return names
