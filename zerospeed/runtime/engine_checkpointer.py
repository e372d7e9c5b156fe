"""`save_checkpoint` / `load_checkpoint` for the engine, in DeepSpeed's layout (DeepSpeed's `DeepSpeedEngine.save_checkpoint` / `_load_checkpoint`).

`EngineCheckpointer` is a component the engine holds (`engine.checkpointer`); the engine's
`save_checkpoint` / `load_checkpoint` are one-line delegates to it. It only sequences, one save
and one load for every run; the pieces live in
`zerospeed/checkpoint/`: the file names (layout.py), the model-states dict (model_states.py), the
atomic write and the manifest (atomic.py, manifest.py, reader.py, [Note: atomic save]), where the
weights go and the one optimizer load rule (weight_files.py, [Note: weight files]: the file set
AutoTP and the pipeline replace with theirs) and the optimizer side with resharding
(zero_checkpoint.py, full_state.py). They read the run through one `CheckpointContext`
(checkpoint/context.py) built by `EngineCheckpointer.context`, and ask the optimizer, never the stage,
which files this rank writes and how its state loads ([Note: checkpoint contract] in
checkpoint/contract.py). Every file holds plain types and loads with `torch.load(weights_only=True)`.
What differs between a plain (or AutoTP) engine and a pipeline engine is one `CheckpointSite`: this
rank's model-parallel rank in file names, the group that commits the tag and the weight file set.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zerospeed import comm
from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.atomic import CheckpointTransaction, read_latest, resolve_tag_dir
from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.checkpoint.deepspeed_format import DEEPSPEED_FORMAT_VERSION, zero_state_for_deepspeed
from zerospeed.checkpoint.layout import LATEST, default_tag
from zerospeed.checkpoint.model_states import build_model_states, to_plain
from zerospeed.checkpoint.reader import CheckpointReader
from zerospeed.checkpoint.scripts import checkpoint_scripts
from zerospeed.checkpoint.universal.engine_load import load_universal_checkpoint
from zerospeed.checkpoint.weight_files import WeightFiles
from zerospeed.checkpoint.contract import NoOptimizer
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.tensor_parallel import checkpoint as tp_checkpoint
from zerospeed.runtime.tensor_parallel.weight_files import ShardedWeightFiles
from zerospeed.utils.logging import logger

__all__ = ["CheckpointHost", "CheckpointSite", "EngineCheckpointer", "plain_checkpoint_site"]


class CheckpointHost(Protocol):
    """What the checkpointer reads of its engine (and the counters a load sets on it)."""

    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    param_names: dict[torch.nn.Parameter, str]
    dp_group: Any
    seq_dp_world_size: int
    run_groups: RunGroups
    _config: Any
    global_steps: int
    global_samples: int
    skipped_steps: int
    loaded_checkpoint_dp_world_size: Any
    loaded_checkpoint_mp_world_size: Any

    @property
    def _training_optimizer(self) -> Any: ...

    @property
    def num_experts(self) -> list[int]: ...

    @property
    def mp_world_size(self) -> int: ...

    def train_batch_size(self) -> int: ...

    def load_universal_checkpoint(self) -> bool: ...


@dataclass(frozen=True)
class CheckpointSite:
    """Where this rank's files go: `mp_rank` names its model-states and optim files, `group` is
    every rank that writes into the tag directory (None: the world), `weight_files` where the
    weights are ([Note: weight files]), `tp_shards` how AutoTP split the parameters (else None)."""

    mp_rank: int
    group: Any
    weight_files: WeightFiles
    tp_shards: dict[str, list[int]] | None = None


def plain_checkpoint_site(module: torch.nn.Module, tensor_parallel: Any, dp_group: Any,
                          bfloat16: bool) -> CheckpointSite:
    """A data-parallel engine's site; under AutoTP the tp rank names the files (DeepSpeed's mp rank)
    and the whole world commits the tag."""
    if tensor_parallel is None:
        return CheckpointSite(0, dp_group, ShardedWeightFiles(bfloat16, 1))
    return CheckpointSite(tensor_parallel.tp_rank, None, ShardedWeightFiles(bfloat16, tensor_parallel.tp_size),
                          tp_checkpoint.shard_record(module))


class EngineCheckpointer:
    """Checkpoint save and load in DeepSpeed's layout for one engine.

    `site` is asked at each save and load (a pipeline engine knows its grid only after its base
    engine is built)."""

    def __init__(self, engine: CheckpointHost, site: Callable[[], CheckpointSite]) -> None:
        self.engine, self._site = engine, site

    # --- save -------------------------------------------------------------------------------------
    def save(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
             save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Called on every rank. See [Note: atomic save] for what a crash leaves behind."""
        if not save_dir:
            raise ValueError("save_checkpoint: save_dir must be a non-empty path")
        self._refuse_partitioned_without_optimizer("save_checkpoint")
        tag = default_tag(self.engine.global_steps) if tag is None else str(tag)
        site = self._site()
        self._validate_tag(tag, site.group)
        ctx = self.context(site)
        files = ctx.optimizer.checkpoint_files(ctx.dp_rank, ctx.mp_rank)   # [Note: checkpoint contract]
        transaction = CheckpointTransaction(save_dir, tag, site.group).begin()
        model_states = None
        if files.model_states is not None:
            model_states = build_model_states(ctx, dict(client_state or {}), exclude_frozen_parameters)
        site.weight_files.write(ctx, transaction, model_states, exclude_frozen_parameters)   # [Note: weight files]
        if files.model_states is not None:
            transaction.write(files.model_states, to_plain(model_states))
        if files.optim_states is not None:
            transaction.write(files.optim_states, {
                C.OPTIMIZER_STATE_DICT: zero_state_for_deepspeed(to_plain(ctx.optimizer.state_dict())),
                C.DS_CONFIG: ctx.ds_config,
                C.DS_VERSION: DEEPSPEED_FORMAT_VERSION})
        transaction.commit(save_latest, extra_files=checkpoint_scripts())
        return True

    def site(self) -> CheckpointSite:
        return self._site()

    def context(self, site: CheckpointSite) -> CheckpointContext:
        """What `checkpoint/` reads of the engine, built here only ([Note: checkpoint contract])."""
        engine = self.engine
        return CheckpointContext(
            module=engine.module,
            optimizer=NoOptimizer() if engine._training_optimizer is None else engine.optimizer,
            lr_scheduler=engine.lr_scheduler, param_names=engine.param_names,
            dp_rank=comm.get_rank(engine.dp_group), dp_world_size=engine.seq_dp_world_size,
            mp_rank=site.mp_rank, mp_world_size=engine.mp_world_size, tp_shards=site.tp_shards,
            ds_config=engine._config._param_dict, num_experts=list(engine.num_experts), run_groups=engine.run_groups,
            global_steps=engine.global_steps, global_samples=engine.global_samples,
            skipped_steps=engine.skipped_steps)

    def _validate_tag(self, tag: str, group: Any) -> None:
        """`checkpoint.tag_validation`, as DeepSpeed: "Ignore" trusts the caller and costs nothing;
        "Warn" and "Fail" compare the tag across the ranks (one all-reduce). On a mismatch DeepSpeed
        only warns under "Warn" and writes each rank's files into its own tag, a split checkpoint
        that loads nowhere; one atomic commit cannot span several tags (the ranks would wait for
        each other's directories), so here "Warn" raises like "Fail" (docs/compatibility.md)."""
        mode = self.engine._config.checkpoint_tag_validation_mode
        if mode == "Ignore":
            return
        digest = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "big")
        # MAX over (digest, -digest): the largest digest and minus the smallest, in one collective.
        bounds = torch.tensor([digest, -digest])
        comm.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=group)
        if bounds[0].item() != -bounds[1].item():
            hint = "" if mode == "Fail" else (f' (checkpoint.tag_validation is "{mode}", but the ranks cannot '
                                              "commit one checkpoint under different tags)")
            raise ValueError(f"checkpoint tag {tag!r} of rank {comm.get_rank()} is not the same on all "
                             f"ranks{hint}; pass the same tag on every rank")

    # --- load -------------------------------------------------------------------------------------
    def _refuse_partitioned_without_optimizer(self, method: str) -> None:
        """ZeRO-3 without an optimizer: the module's state dict holds partitions, which a checkpoint
        would store as empty tensors ([Note: engine without an optimizer] in engine.py)."""
        if self.engine._training_optimizer is None and self.engine.optimizer is not None:
            raise NotImplementedError(f"{method} on a ZeRO-3 engine without an optimizer is not implemented; "
                                      "save the weights with save_16bit_model() or iter_full_weights(), "
                                      "load them into the model before initialize")

    def load(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
             load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
             load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        self._refuse_partitioned_without_optimizer("load_checkpoint")
        if self.engine.load_universal_checkpoint():   # `latest_universal` and zero/<param>/*.pt
            return load_universal_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
        tag_dir = _tag_dir_to_load(load_dir, tag)
        if tag_dir is None:
            return None, None
        # [Note: weight files]: the one load sequence, the files in this order
        reader = CheckpointReader(tag_dir)   # every listed file present: a missing one is named
        site = self._site()
        ctx, weights = self.context(site), site.weight_files
        model_path = weights.model_file(ctx, reader)
        model_state = reader.load(model_path)
        saved = weights.saved_layout(ctx, reader, model_state)
        weights.load_module(ctx, reader, saved, model_state, load_module_strict, custom_load_fn)
        loaded_optimizer = loaded_scheduler = False
        if load_module_only:
            weights.load_optimizer(ctx, reader, saved, model_state, load_optimizer_states=False)
        else:
            loaded_scheduler = self.load_scheduler(model_state, load_lr_scheduler_states)
            self.load_counters(model_state)
            if self.engine._training_optimizer is not None:
                weights.load_optimizer(ctx, reader, saved, model_state, load_optimizer_states)
                loaded_optimizer = load_optimizer_states
        comm.barrier(site.group)
        return model_path, _client_state(model_state, loaded_optimizer, loaded_scheduler)

    def load_scheduler(self, model_state: dict[str, Any], wanted: bool) -> bool:
        saved, scheduler = model_state.get(C.LR_SCHEDULER), self.engine.lr_scheduler
        if wanted and scheduler is not None and saved is not None:
            scheduler.load_state_dict(saved)
            return True
        return False

    def load_counters(self, model_state: dict[str, Any]) -> None:
        engine = self.engine
        engine.global_steps = int(model_state[C.GLOBAL_STEPS])
        engine.global_samples = int(model_state.get(C.GLOBAL_SAMPLES, engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(model_state[C.SKIPPED_STEPS])
        engine.loaded_checkpoint_dp_world_size = model_state.get(C.DP_WORLD_SIZE)
        engine.loaded_checkpoint_mp_world_size = model_state.get(C.MP_WORLD_SIZE)


def _tag_dir_to_load(load_dir: str, tag: Any) -> str | None:
    """The tag directory to read; None (after DeepSpeed's warning) when there is nothing to load."""
    if tag is None:
        if not os.path.isdir(load_dir):  # DeepSpeed's return value, with the actual reason
            logger.warning(f"Unable to load a checkpoint: the checkpoint directory {load_dir} does not exist; "
                           "nothing was loaded")
            return None
        tag = read_latest(load_dir)  # a damaged `latest` raises, naming the file
        if tag is None:
            latest = os.path.join(load_dir, LATEST)
            logger.warning(f"Unable to find latest file at {latest}, if trying to load latest checkpoint "
                           "please ensure this file exists or pass an explicit checkpoint tag when loading "
                           "a checkpoint.")
            return None
    tag_dir = resolve_tag_dir(load_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint directory {tag_dir} does not exist")
    return tag_dir


def _client_state(model_state: dict[str, Any], loaded_optimizer: bool, loaded_scheduler: bool) -> dict[str, Any]:
    excluded = set(C.CLIENT_STATE_EXCLUDED_KEYS)
    if loaded_optimizer:
        excluded.add(C.OPTIMIZER)
    if loaded_scheduler:
        excluded.add(C.LR_SCHEDULER)
    return {key: value for key, value in model_state.items() if key not in excluded}

