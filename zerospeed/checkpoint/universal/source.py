"""The checkpoint a universal conversion reads: its files by model-parallel rank, and how they combine.

A tag directory holds one set of ZeRO files per model-parallel rank (`mp_rank_SS` in the names):
one set without model parallelism; one per tp rank under AutoTP, each holding its *piece* of every
split parameter, joined along the split dimension (tp_pieces.py, the model file's `autotp_shards`
record); one per pipeline stage, each holding *other* parameters (a stage's layers, named by global
layer index, so the union is the whole model; a tied weight is in several stages, equal in each,
and taken from the first). Either way the result is [Note: full layout] (full_state.py) of the
whole model, which is what a universal folder stores, experts of an MoE checkpoint under their
global ids (moe_reshard.py). Refused by name: DeepSpeed's MoE checkpoints (no expert rank layout),
its Megatron-style tp checkpoints (no shard record), MoE with tp or pipeline stages, and a
pipeline with tp inside a stage.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.full_state import FullOptimizerState, merge_param_shapes, unite_stage_states
from zerospeed.checkpoint.layout import model_states_name
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.moe_reshard import EP_SIZES_KEY
from zerospeed.checkpoint.tp_pieces import full_shape, join_tp_states, saved_tp_size
from zerospeed.checkpoint.zero_checkpoint import SavedLayout, discover

__all__ = ["CheckpointSource", "checkpoint_source"]

_EXPERT_FILE = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$")
_LAYER_FILE = re.compile(r"layer_\d+(-model_\d+)?-model_states\.pt$")


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """Per model-parallel rank (one entry without model parallelism) its saved layout and its dp
    rank 0 model-states file (mmap'd: its module weights are never all needed); the AutoTP shard
    record; `pipeline`: the ranks are pipeline stages; `moe`: expert files beside (zerospeed's,
    with its expert rank layout); every model-states file (copied over)."""

    saved: list[SavedLayout]
    model_states: list[dict[str, Any]]
    record: dict[str, list[int]]
    pipeline: bool
    moe: bool
    model_files: list[str]

    def full_shapes(self) -> dict[str, torch.Size]:
        """Every optimized parameter's whole shape, in flat order (stage by stage for a pipeline)."""
        if self.pipeline:
            shapes: dict[str, torch.Size] = {}
            for model_state in self.model_states:
                for name, shape in merge_param_shapes(model_state[C.PARAM_SHAPES]).items():
                    shapes.setdefault(name, shape)
            return shapes
        pieces = merge_param_shapes(self.model_states[0][C.PARAM_SHAPES])
        return {name: full_shape(shape, self.record.get(name), len(self.saved)) for name, shape in pieces.items()}

    def combine(self, per_rank: list[FullOptimizerState]) -> FullOptimizerState:
        """Every model-parallel rank's full-layout state (rank order) as the whole model's."""
        return unite_stage_states(per_rank) if self.pipeline else join_tp_states(per_rank, self.record)


def checkpoint_source(tag_dir: str) -> CheckpointSource:
    """The tag's files by model-parallel rank; layouts not converted yet are refused by name."""
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"--input_folder {tag_dir} is not a checkpoint tag directory")
    first = discover(tag_dir, bf16_first=True)
    names = [os.path.basename(path) for path in first.model_files]
    if first.zero_stage == 0:
        raise ValueError(f"{tag_dir} has no ZeRO optimizer files (*_optim_states.pt): the universal format "
                         "converts ZeRO stage 1-3 checkpoints")
    model_states = [load_file(_model_file(tag_dir, first.zero_stage, 0), mmap=True)]
    moe = any(_EXPERT_FILE.search(name) for name in names)
    if moe and not model_states[0].get(EP_SIZES_KEY):
        raise NotImplementedError(f"{tag_dir} holds MoE expert files without zerospeed's '{EP_SIZES_KEY}' record "
                                  "(a DeepSpeed MoE checkpoint): its conversion to the universal format is not "
                                  "implemented yet")
    # layer files end in "-model_states.pt", outside discover's "*_model_states.pt"
    layer_files = sorted(path for path in glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt"))
                         if _LAYER_FILE.search(os.path.basename(path)))
    pipeline = bool(layer_files)
    num_ranks = _model_parallel_size(tag_dir, model_states[0], pipeline)
    if moe and num_ranks > 1:
        raise NotImplementedError(f"{tag_dir} is an MoE checkpoint with tensor or pipeline parallelism: its "
                                  "conversion to the universal format is not implemented yet")
    if any(int(rank) >= num_ranks for rank in re.findall(r"mp_rank_(\d+)", " ".join(names))):
        raise ValueError(f"{tag_dir} holds files of mp ranks beyond its mp_world_size {num_ranks}")
    model_states += [load_file(_model_file(tag_dir, first.zero_stage, r), mmap=True) for r in range(1, num_ranks)]
    saved = [first] + [discover(tag_dir, bf16_first=True, mp_rank=r) for r in range(1, num_ranks)]
    record = {} if pipeline else model_states[0].get(C.TP_SHARDS_KEY) or {}
    return CheckpointSource(saved, model_states, record, pipeline, moe, first.model_files + layer_files)


def _model_parallel_size(tag_dir: str, model_state: dict[str, Any], pipeline: bool) -> int:
    """The number of `mp_rank_SS` file sets: tp ranks, or pipeline stages (refused: both at once)."""
    size = saved_tp_size(model_state)
    if pipeline:
        dims = model_state.get(C.CHECKPOINT_PARALLEL_DIMENSIONS) or {}
        if int(dims.get("tp_degree", 1)) > 1 or int(dims.get("pp_degree", size)) != size:
            raise NotImplementedError(f"{tag_dir} is a pipeline checkpoint with tensor parallelism inside its stages "
                                      f"({dims}): its conversion to the universal format is not implemented yet")
        return size
    if size > 1 and C.TP_SHARDS_KEY not in model_state:
        raise NotImplementedError(f"{tag_dir} is a tensor-parallel checkpoint (mp_world_size {size}) without the "
                                  f"'{C.TP_SHARDS_KEY}' record zerospeed's AutoTP writes: its conversion to the "
                                  "universal format is not implemented yet")
    return size


def _model_file(tag_dir: str, zero_stage: int, mp_rank: int) -> str:
    """Model-parallel rank `mp_rank`'s model-states file of dp rank 0 (stage 3: one per dp rank, alike)."""
    path = os.path.join(tag_dir, model_states_name(zero_stage, 0, mp_rank))
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {tag_dir}: {os.path.basename(path)} is missing (the conversion needs "
                                "every model-parallel rank's files)")
    return path
