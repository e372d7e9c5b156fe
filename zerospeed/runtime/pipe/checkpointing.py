"""Pipeline checkpoints in DeepSpeed's layout (DeepSpeed's `deepspeed/runtime/pipe/module.py::PipelineModule.save_state_dict` / `load_state_dir`): the pipeline's file set in the one save / load sequence.

    <tag>/layer_XX[-model_YY]-model_states.pt         one per layer with weights: layer.state_dict()
    <tag>/mp_rank_SS_model_states.pt                   one per stage (x tensor rank): `module: None`,
                                                       counters, scheduler, stage-0 optimizer state
    <tag>/[bf16_]zero_pp_rank_D_mp_rank_SS_optim_states.pt   ZeRO >= 1: one per stage and dp rank

`PipelineEngine` saves and loads through the engine's one sequence (runtime/engine_checkpointer.py,
[Note: weight files] in checkpoint/weight_files.py, the manifest checked first like every load);
what it contributes is its `CheckpointSite`: `PipelineLayerFiles`, where the weights are, and its model-parallel rank
(the stage's, which names its model-states and optim files). Layer files are keyed by the
*global* layer index, so they do not depend on how the layers were partitioned: a run with another
partition or stage count reads them as they are. Each stage's data-parallel rank 0 writes its
layers (DeepSpeed's default; `checkpoint.parallel_write.pipeline_stage` spreads them over the
data-parallel ranks). The optimizer state follows the one rule: the same layout (stage count, this
stage's parameters, ZeRO stage, data-parallel size of partitioned state) loads each rank's own
files; another one reads every stage's files into the whole model's state and cuts this rank's
([Note: pipeline optimizer resharding] in optimizer_reshard.py); the weights load under any layout.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.layout import model_states_name
from zerospeed.checkpoint.reader import CheckpointReader
from zerospeed.checkpoint.weight_files import WeightFiles
from zerospeed.checkpoint.zero_checkpoint import SavedLayout, discover
from zerospeed.runtime.engine_checkpointer import CheckpointSite
from zerospeed.runtime.pipe.optimizer_reshard import (PipelineLayout, check_fits, pipeline_full_state,
                                                      same_stage_params, saved_pipeline_layout,
                                                      saved_stage_count)
from zerospeed.runtime.pipe.partition import partition_uniform

__all__ = ["PipelineLayerFiles", "pipeline_checkpoint_site"]


def _layer_state(layer: Any, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    if not isinstance(layer, torch.nn.Module):
        return None  # functions and forward_fn partials hold no weights
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    if exclude_frozen:
        for name, param in layer.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
    return state


class PipelineLayerFiles(WeightFiles):
    """[Note: weight files] of a pipeline stage: one file per layer. `layers_to_write`: (local
    index, layer) of the layers this rank writes; `parallel_dims`: the stage's model-parallel size
    and DeepSpeed's `pp_degree` / `tp_degree`, which its model-states file records."""

    def __init__(self, bf16: bool, module: Any, layers_to_write: list[tuple[int, Any]], global_rank: int,
                 mp_world_size: int, parallel_dims: dict[str, int]) -> None:
        super().__init__(bf16)
        self.module, self.layers_to_write, self.global_rank = module, layers_to_write, global_rank
        self.mp_world_size, self.parallel_dims = mp_world_size, parallel_dims

    def write(self, ctx: CheckpointContext, transaction: Any, model_states: dict[str, Any] | None,
              exclude_frozen: bool) -> None:
        for local_index, layer in self.layers_to_write:
            state = _layer_state(layer, exclude_frozen)
            if state is not None:
                transaction.write(os.path.basename(self.module.ckpt_layer_path("", local_index)), state)
        if model_states is not None:
            model_states[C.MODULE] = None  # the weights are in the layer files, as DeepSpeed
            model_states[C.MP_WORLD_SIZE] = self.mp_world_size
            model_states[C.CHECKPOINT_PARALLEL_DIMENSIONS] = dict(self.parallel_dims)

    def model_file(self, ctx: CheckpointContext, reader: CheckpointReader) -> str:
        """This stage's model-states file, or stage 0's where the checkpoint was saved with fewer
        stages (the counters and the scheduler are the same in every stage's; the optimizer state
        then reshards, [Note: pipeline optimizer resharding])."""
        path = reader.path(model_states_name(0, mp_rank=ctx.mp_rank))
        if os.path.isfile(path):
            return path
        first = reader.path(model_states_name(0, mp_rank=0))
        if not os.path.isfile(first):
            raise FileNotFoundError(f"pipeline checkpoint {reader.tag_dir} has neither {os.path.basename(path)} "
                                    f"(this stage's) nor {os.path.basename(first)}")
        return first

    def saved_layout(self, ctx: CheckpointContext, reader: CheckpointReader, model_state: dict[str, Any]) -> SavedLayout:
        """This stage's saved files, or stage 0's where the stage count changed (the ZeRO stage and
        dp size are the same in every stage's)."""
        same_stages = saved_stage_count(model_state) == self.parallel_dims["pp_degree"]
        return discover(reader.tag_dir, bf16_first=self.bf16, mp_rank=ctx.mp_rank if same_stages else 0)

    def load_module(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                    model_state: dict[str, Any], strict: bool, custom_load_fn: Any) -> None:
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported with pipeline parallelism (as DeepSpeed)")
        self._load_layers(reader, strict)

    def universal_model_file(self, ctx: CheckpointContext, reader: CheckpointReader) -> str:
        """This stage's model-states file, or stage 0's where the folder was saved with fewer stages
        (the counters and the scheduler are the same in every stage's)."""
        path = reader.path(model_states_name(0, mp_rank=ctx.mp_rank))
        return path if os.path.isfile(path) else reader.path(model_states_name(0, mp_rank=0))

    def load_universal_module(self, ctx: CheckpointContext, reader: CheckpointReader,
                              model_state: dict[str, Any]) -> None:
        """The layer files zerospeed's converter copies into the folder, keyed by global layer index:
        buffers and frozen weights of any partition (the trained weights then come from `zero/`).
        DeepSpeed's converter copies none: the layers then keep their initial buffers, as DeepSpeed."""
        self._load_layers(reader, strict=True, required=False)

    def _load_layers(self, reader: CheckpointReader, strict: bool, required: bool = True) -> None:
        tag_dir = reader.tag_dir
        rank_repr = self.module.topology().get_rank_repr(rank=self.global_rank)
        for local_index, layer in enumerate(self.module.forward_funcs):
            if not isinstance(layer, torch.nn.Module):
                continue
            path = self.module.ckpt_layer_path(tag_dir, local_index)
            if not os.path.isfile(path):
                found = sorted(glob.glob(os.path.join(tag_dir, os.path.basename(path).split("-")[0] + "-*model_states.pt")))
                if not found and not required:
                    continue
                if len(found) != 1:
                    raise FileNotFoundError(f"no layer file {path} (found {found}); rank {rank_repr or 'plain'}")
                path = found[0]
            layer.load_state_dict(reader.load(path), strict=strict)
        self.module.tied_comms.synchronize_weights()

    def layout_changed(self, ctx: CheckpointContext, saved: SavedLayout, model_state: dict[str, Any]) -> bool:
        """Another stage count, or another partition of the layers (this stage's parameters differ
        from those its saved files hold); the ZeRO stage and dp size the optimizer's layout shows."""
        return (saved_stage_count(model_state) != self.parallel_dims["pp_degree"]
                or not same_stage_params(model_state.get(C.PARAM_SHAPES), ctx.optimizer.param_shapes(ctx.param_names)))

    def load_own_optimizer_state(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout) -> bool:
        return False   # no per-ep-rank files in a pipeline checkpoint: the stage's own files hold its state

    def full_state(self, ctx: CheckpointContext, reader: CheckpointReader, saved: SavedLayout,
                   model_state: dict[str, Any]) -> FullOptimizerState:
        """Every saved stage's state united ([Note: pipeline optimizer resharding]); the wrapper's
        `load_full_state` takes this stage's parameters from it."""
        saved_pipeline = saved_pipeline_layout(model_state, saved)
        loading = PipelineLayout(self.parallel_dims["pp_degree"], ctx.dp_world_size,
                                 ctx.optimizer.checkpoint_layout().zero_stage, self.parallel_dims["tp_degree"])
        if ctx.has_moe_layers:
            raise ValueError(f"pipeline checkpoint {reader.tag_dir} was saved at {saved_pipeline} and is loaded at "
                             f"{loading}: resharding the optimizer state of MoE layers inside a pipeline is not "
                             "implemented; load it at its own layout, or pass load_optimizer_states=False")
        full = pipeline_full_state(reader.tag_dir, saved_pipeline, loading, self.bf16, reader.load)
        shapes = {name: torch.Size(getattr(param, "ds_shape", param.shape))
                  for param, name in ctx.param_names.items() if param.requires_grad}
        check_fits(full, shapes, reader.tag_dir, saved_pipeline, loading)
        return full


def pipeline_checkpoint_site(engine: Any) -> CheckpointSite:
    """A pipeline stage's site: the stage's model-parallel rank names its model-states and optim
    files, and every stage writes into the one tag directory (the whole world commits it)."""
    grid = engine.grid
    weights = PipelineLayerFiles(
        engine.bfloat16_enabled(), engine.module, _layers_to_write(engine), engine.global_rank,
        mp_world_size=grid.get_model_parallel_world_size(),
        parallel_dims={"pp_degree": engine.num_stages, "tp_degree": grid.get_slice_parallel_world_size()})
    return CheckpointSite(int(grid.get_model_parallel_rank()), None, weights)


def _layers_to_write(engine: Any) -> list[tuple[int, Any]]:
    local = list(zip(range(len(engine.module.forward_funcs)), engine.module.forward_funcs))
    dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    if engine._config.checkpoint_config.parallel_write.pipeline_stage:
        bounds = partition_uniform(len(local), dp_size)
        return local[bounds[dp_rank]:bounds[dp_rank + 1]]
    return local if dp_rank == 0 else []
