"""`ShardedWeightFiles`: AutoTP's contribution to the one checkpoint sequence ([Note: weight files] in checkpoint/weight_files.py).

Every run outside a pipeline loads through it, with or without AutoTP: the model-states files are
one per tp rank and record how each split parameter was cut (`autotp_shards`), so a checkpoint
saved at one tp size loads at another, at any ZeRO stage on either side, the module state cut
from the joined weights and the optimizer state from the joined full state ([Note: AutoTP checkpoint layout] in checkpoint.py,
[Note: AutoTP optimizer resharding] in optimizer_reshard.py).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.reader import CheckpointReader
from zerospeed.checkpoint.tp_pieces import full_shape
from zerospeed.checkpoint.weight_files import WeightFiles
from zerospeed.checkpoint.zero_checkpoint import SavedLayout, discover
from zerospeed.runtime.tensor_parallel.checkpoint import saved_tp_size, tp_module_state
from zerospeed.runtime.tensor_parallel.optimizer_reshard import cut_tp_pieces, tp_resharded_optimizer_state
from zerospeed.runtime.tensor_parallel.state_dict import split_params

__all__ = ["ShardedWeightFiles"]


class ShardedWeightFiles(WeightFiles):
    """`tp_size`: this run's (1 without AutoTP)."""

    def __init__(self, bf16: bool, tp_size: int) -> None:
        super().__init__(bf16)
        self.tp_size = tp_size

    def saved_layout(self, ctx: CheckpointContext, reader: CheckpointReader, model_state: dict[str, Any]) -> SavedLayout:
        """The saved layout for this tp rank (tp rank 0's when the tp size changed); the module state
        resharded first when the tp size changed, except at ZeRO-3, whose module files hold
        placeholders (the weights then come from the optim files' masters, through `full_state`)."""
        tag_dir, saved_tp = reader.tag_dir, saved_tp_size(model_state)
        same_tp = saved_tp == self.tp_size
        saved = discover(tag_dir, bf16_first=self.bf16, mp_rank=ctx.mp_rank if same_tp else 0)
        if not same_tp and saved.zero_stage < 3:
            model_state[C.MODULE] = tp_module_state(ctx.module, tag_dir, model_state, self.tp_size, reader.load)
        return saved

    def layout_changed(self, ctx: CheckpointContext, saved: SavedLayout, model_state: dict[str, Any]) -> bool:
        return saved_tp_size(model_state) != self.tp_size or super().layout_changed(ctx, saved, model_state)

    def full_state(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                   model_state: dict[str, Any]) -> FullOptimizerState:
        if saved_tp_size(model_state) == self.tp_size:
            return super().full_state(ctx, reader, saved, model_state)
        return tp_resharded_optimizer_state(ctx.module, saved.tag_dir, model_state, self.bf16, reader.load)

    def universal_shape(self, name: str, param: torch.nn.Parameter) -> torch.Size:
        """A split parameter's full shape: its piece's, times the tp size along the split dimension."""
        shard = getattr(param, "ds_tp_shard", None)
        piece = super().universal_shape(name, param)
        return piece if shard is None else full_shape(piece, [shard.dim, shard.fused_parts], shard.tp_size)

    def own_universal_state(self, ctx: CheckpointContext, full: FullOptimizerState) -> FullOptimizerState:
        return cut_tp_pieces(full, ctx.module) if split_params(ctx.module) else full
