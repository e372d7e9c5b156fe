"""Pipeline checkpoints in DeepSpeed's layout (DeepSpeed's `deepspeed/runtime/pipe/module.py::PipelineModule.save_state_dict` / `load_state_dir`), written and read by `PipelineEngine`.

    <tag>/layer_XX[-model_YY]-model_states.pt         one per layer with weights: layer.state_dict()
    <tag>/mp_rank_SS_model_states.pt                   one per stage (x tensor rank): `module: None`,
                                                       counters, scheduler, stage-0 optimizer state
    <tag>/[bf16_]zero_pp_rank_D_mp_rank_SS_optim_states.pt   ZeRO >= 1: one per stage and dp rank

Layer files are keyed by the *global* layer index, so they do not depend on how the layers were
partitioned: a run with another partition or stage count reads them as they are. Each stage's
data-parallel rank 0 writes its layers (DeepSpeed's default; `checkpoint.parallel_write.pipeline_stage`
spreads them over the data-parallel ranks). The save is one atomic transaction over every rank
([Note: atomic save] in checkpoint/atomic.py). The optimizer state is restored only when the
stage layout and data-parallel size are those of the save (resharding pipeline optimizer state
is not implemented); the weights load under any layout.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from zerospeed import comm
from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.atomic import CheckpointTransaction, read_latest, resolve_tag_dir
from zerospeed.checkpoint.deepspeed_format import DEEPSPEED_FORMAT_VERSION, zero_state_for_deepspeed
from zerospeed.checkpoint.layout import default_tag, model_states_name, optim_states_name
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.model_states import build_model_states, to_plain
from zerospeed.checkpoint.scripts import checkpoint_scripts
from zerospeed.checkpoint.zero_checkpoint import stage0_wrapper_state
from zerospeed.runtime.pipe.partition import partition_uniform
from zerospeed.utils.logging import logger

__all__ = ["PipelineCheckpointing"]


def _layer_state(layer: Any, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    if not isinstance(layer, torch.nn.Module):
        return None  # functions and forward_fn partials hold no weights
    state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    if exclude_frozen:
        for name, param in layer.named_parameters():
            if not param.requires_grad:
                state.pop(name, None)
    return state


class PipelineCheckpointing:
    """Mixin of PipelineEngine: save_checkpoint / load_checkpoint in DeepSpeed's pipeline layout."""

    def _mp_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def _layers_to_write(self) -> list[tuple[int, Any]]:
        local = list(zip(range(len(self.module.forward_funcs)), self.module.forward_funcs))
        dp_rank, dp_size = self.grid.get_data_parallel_rank(), self.grid.get_data_parallel_world_size()
        if self._config.checkpoint_config.parallel_write.pipeline_stage:
            bounds = partition_uniform(len(local), dp_size)
            return local[bounds[dp_rank]:bounds[dp_rank + 1]]
        return local if dp_rank == 0 else []

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] = {},  # noqa: B006
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        if not save_dir:
            raise ValueError("save_checkpoint: save_dir must be a non-empty path")
        tag = default_tag(self.global_steps) if tag is None else str(tag)
        self._validate_tag(tag)
        ctx = self._checkpoint_context()
        optim_file = ctx.optimizer.checkpoint_files(ctx.dp_rank, self._mp_rank()).optim_states
        transaction = CheckpointTransaction(save_dir, tag, None).begin()
        for local_index, layer in self._layers_to_write():
            state = _layer_state(layer, exclude_frozen_parameters)
            if state is not None:
                path = self.module.ckpt_layer_path("", local_index)
                transaction.write(os.path.basename(path), state)
        if ctx.dp_rank == 0:
            model_states = build_model_states(ctx, dict(client_state), exclude_frozen_parameters)
            model_states[C.MODULE] = None  # the weights are in the layer files, as DeepSpeed
            model_states[C.MP_WORLD_SIZE] = self.grid.get_model_parallel_world_size()
            model_states[C.CHECKPOINT_PARALLEL_DIMENSIONS] = {
                "pp_degree": self.num_stages, "tp_degree": self.grid.get_slice_parallel_world_size()}
            transaction.write(model_states_name(0, mp_rank=self._mp_rank()), to_plain(model_states))
        if optim_file is not None:   # partitioned optimizer state ([Note: checkpoint contract])
            transaction.write(optim_file, {
                C.OPTIMIZER_STATE_DICT: zero_state_for_deepspeed(to_plain(ctx.optimizer.state_dict())),
                C.DS_CONFIG: self._config._param_dict, C.DS_VERSION: DEEPSPEED_FORMAT_VERSION})
        transaction.commit(save_latest, extra_files=checkpoint_scripts())
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported with pipeline parallelism (as DeepSpeed)")
        if self.load_universal_checkpoint():   # docs/checkpointing.md, universal checkpoints: not yet
            raise NotImplementedError("checkpoint.load_universal: universal checkpoints do not load into a "
                                      "pipeline engine yet")
        if tag is None:
            tag = read_latest(load_dir) if os.path.isdir(load_dir) else None
            if tag is None:
                logger.warning(f"Unable to find latest file at {os.path.join(load_dir, 'latest')}; nothing was loaded")
                return None, None
        tag_dir = resolve_tag_dir(load_dir, str(tag))
        if not os.path.isdir(tag_dir):
            raise FileNotFoundError(f"checkpoint directory {tag_dir} does not exist")
        self._load_layers(tag_dir, load_module_strict)
        model_path = os.path.join(tag_dir, model_states_name(0, mp_rank=self._mp_rank()))
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"pipeline checkpoint {tag_dir} has no {os.path.basename(model_path)} for this "
                                    f"stage (saved with another number of stages?)")
        model_state = load_file(model_path)
        loaded_optimizer = loaded_scheduler = False
        if not load_module_only:
            loaded_scheduler = self._load_scheduler(model_state, load_lr_scheduler_states)
            self._load_counters(model_state)
            if self.optimizer is not None and load_optimizer_states:
                self._load_pipeline_optimizer(tag_dir, model_state)
                loaded_optimizer = True
        comm.barrier()
        from zerospeed.runtime.engine_checkpointing import _client_state

        return model_path, _client_state(model_state, loaded_optimizer, loaded_scheduler)

    def _load_layers(self, tag_dir: str, strict: bool) -> None:
        rank_repr = self.module.topology().get_rank_repr(rank=self.global_rank)
        for local_index, layer in enumerate(self.module.forward_funcs):
            if not isinstance(layer, torch.nn.Module):
                continue
            path = self.module.ckpt_layer_path(tag_dir, local_index)
            if not os.path.isfile(path):
                found = sorted(glob.glob(os.path.join(tag_dir, os.path.basename(path).split("-")[0] + "-*model_states.pt")))
                if len(found) != 1:
                    raise FileNotFoundError(f"no layer file {path} (found {found}); rank {rank_repr or 'plain'}")
                path = found[0]
            layer.load_state_dict(load_file(path), strict=strict)
        self.module.tied_comms.synchronize_weights()

    def _load_pipeline_optimizer(self, tag_dir: str, model_state: dict[str, Any]) -> None:
        ctx = self._checkpoint_context()
        saved_dp = model_state.get(C.DP_WORLD_SIZE)
        if saved_dp != self.dp_world_size:
            raise ValueError(f"pipeline checkpoint {tag_dir} was saved with data-parallel size {saved_dp}, this run "
                             f"has {self.dp_world_size}: pass load_optimizer_states=False to load the weights only")
        if ctx.optimizer.checkpoint_files(ctx.dp_rank, self._mp_rank()).optim_states is None:   # replicated state
            if model_state.get(C.OPTIMIZER) is None:
                raise ValueError(f"pipeline checkpoint {tag_dir} holds no stage-0 optimizer state "
                                 "(saved with ZeRO >= 1?): pass load_optimizer_states=False")
            # DeepSpeed's or ours, in any of DeepSpeed's stage-0 shapes (checkpoint/deepspeed_format.py).
            entry = stage0_wrapper_state(ctx, model_state[C.OPTIMIZER])
            self.optimizer.load_state_dict(entry, load_optimizer_states=True)
            return
        candidates = [optim_states_name(ctx.dp_rank, bf16, self._mp_rank()) for bf16 in (self.bfloat16_enabled(),
                                                                                      not self.bfloat16_enabled())]
        for name in candidates:
            if os.path.isfile(os.path.join(tag_dir, name)):
                own = load_file(os.path.join(tag_dir, name))[C.OPTIMIZER_STATE_DICT]
                self.optimizer.load_state_dict(own, load_optimizer_states=True)
                return
        raise FileNotFoundError(f"pipeline checkpoint {tag_dir} has none of {candidates}")
