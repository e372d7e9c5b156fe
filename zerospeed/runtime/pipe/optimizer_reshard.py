"""The optimizer state of a pipeline checkpoint loaded at another layout: another number of stages, another partition of the layers, another data-parallel size or ZeRO stage.

[Note: pipeline optimizer resharding]
A pipeline checkpoint keeps one set of ZeRO files per stage (``mp_rank_{stage}`` in the names),
each holding the optimizer state of its stage's parameters, which are named by global layer
index (``3.weight``; a tied weight ``tied_modules.<key>.weight`` in every stage holding it). The
names do not depend on the partition, so the whole model's state is the union of the stages'
(full_state.py `unite_stage_states`: a tied weight's copies are updated alike in every stage, the
first is taken). A run at another layout reads every saved stage's files into that one full
layout (fp32 masters, Adam moments, step by name) and its wrapper's `load_full_state` cuts the
parameters of this rank's stage, then its ZeRO partition: masters and moments come back exactly.
Same layout (stage count, this stage's parameters, ZeRO stage and dp size): each rank reads its
own files, as DeepSpeed.

Refused, naming both layouts: optimizer state replicated in the stages' model-states files
(ZeRO stage 0 on the saving side: the masters of an fp32 run are the layer files' weights, which
this path does not read), MoE layers in a pipeline (their experts are named per expert-parallel
rank, [Note: MoE stage-3 reshard]), a checkpoint with tensor parallelism inside its stages, and a
module this checkpoint's parameters no longer fit (a parameter missing or of another shape).
DeepSpeed 0.19.8 has no direct route: its pipeline checkpoints reload only at their own layout,
or through ``ds_to_universal`` and ``load_universal``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.full_state import FullOptimizerState, merge_param_shapes, unite_stage_states
from zerospeed.checkpoint.layout import model_states_name
from zerospeed.checkpoint.zero_checkpoint import SavedLayout, discover, export_full_state

__all__ = ["PipelineLayout", "check_fits", "pipeline_full_state", "same_stage_params", "saved_pipeline_layout",
           "saved_stage_count"]


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """A pipeline run's layout as a checkpoint sees it, for comparisons and error messages."""

    stages: int
    dp_world_size: int
    zero_stage: int
    tp_size: int = 1

    def __str__(self) -> str:
        tp = f" x tp {self.tp_size}" if self.tp_size > 1 else ""
        return f"{self.stages} pipeline stage(s) x dp {self.dp_world_size}{tp}, ZeRO stage {self.zero_stage}"


def saved_stage_count(model_state: dict[str, Any]) -> int:
    """The stage count a stage's model-states file records (DeepSpeed's `checkpoint_parallel_dimensions`)."""
    dims = model_state.get(C.CHECKPOINT_PARALLEL_DIMENSIONS) or {}
    return int(dims.get("pp_degree") or model_state.get(C.MP_WORLD_SIZE) or 1)


def saved_pipeline_layout(model_state: dict[str, Any], saved: SavedLayout) -> PipelineLayout:
    """The layout a checkpoint was saved at, from a stage's model-states file and its saved files."""
    dims = model_state.get(C.CHECKPOINT_PARALLEL_DIMENSIONS) or {}
    dp = int(model_state.get(C.DP_WORLD_SIZE) or saved.dp_world_size)
    return PipelineLayout(saved_stage_count(model_state), dp, saved.zero_stage, int(dims.get("tp_degree") or 1))


def pipeline_full_state(tag_dir: str, saved: PipelineLayout, loading: PipelineLayout, bf16: bool,
                        load: Callable[[str], dict[str, Any]]) -> FullOptimizerState:
    """The whole model's optimizer state from every saved stage's files ([Note: pipeline
    optimizer resharding]); `load` reads a model-states file (checksummed)."""
    refusal = _refusal(saved)
    if refusal:
        raise ValueError(f"pipeline checkpoint {tag_dir} was saved at {saved} and is loaded at {loading}: "
                         f"{refusal}; load it at its own layout, or pass load_optimizer_states=False to load "
                         "the weights only")
    per_stage = []
    for stage in range(saved.stages):
        layout = discover(tag_dir, bf16_first=bf16, mp_rank=stage)
        path = os.path.join(tag_dir, model_states_name(layout.zero_stage, 0, stage))
        if not os.path.isfile(path) or layout.zero_stage != saved.zero_stage:
            raise FileNotFoundError(f"pipeline checkpoint {tag_dir} (saved at {saved}) lacks the ZeRO stage "
                                    f"{saved.zero_stage} files of pipeline stage {stage} ({os.path.basename(path)} "
                                    "and its optim files): resharding needs every stage's files")
        per_stage.append(export_full_state(layout, load(path)))
    return unite_stage_states(per_stage)


def _refusal(saved: PipelineLayout) -> str:
    if saved.zero_stage == 0:
        return ("its optimizer state is replicated in each stage's model-states file (ZeRO stage 0), which "
                "does not reshard to another layout")
    if saved.tp_size > 1:
        return "resharding a checkpoint with tensor parallelism inside its stages is not implemented"
    return ""


def check_fits(full: FullOptimizerState, shapes: dict[str, torch.Size], tag_dir: str, saved: PipelineLayout,
               loading: PipelineLayout) -> None:
    """Every parameter of this rank's stage in the checkpoint, at its shape: else the module no
    longer fits the checkpoint (another model, or layers the saved partition did not have)."""
    for name, shape in shapes.items():
        found = full.fp32.get(name)
        if found is None or found.shape != shape:
            what = "is not in it" if found is None else f"has shape {tuple(found.shape)} there"
            raise ValueError(f"pipeline checkpoint {tag_dir} (saved at {saved}) does not fit this run's module "
                             f"(loaded at {loading}): parameter {name!r} of shape {tuple(shape)} {what}")


def same_stage_params(saved_shapes: Any, current_shapes: Any) -> bool:
    """A stage's saved `param_shapes` and this rank's, the same parameters in the same order (each
    rank's own files then fit it). A file without the record (DeepSpeed's at ZeRO stage 0) is taken
    to fit: only its stage count can tell."""
    if saved_shapes is None:
        return True
    return list(merge_param_shapes(saved_shapes).items()) == list(merge_param_shapes(current_shapes or []).items())
