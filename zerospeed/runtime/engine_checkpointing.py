"""`save_checkpoint` / `load_checkpoint` for the engine, in DeepSpeed's layout (DeepSpeed's `DeepSpeedEngine.save_checkpoint` / `_load_checkpoint`).

The mixin only sequences, one save and one load for every run; the pieces live in
`zerospeed/checkpoint/`: the file names (layout.py), the model-states dict (model_states.py), the
atomic write and the manifest (atomic.py, manifest.py, reader.py, [Note: atomic save]), where the
weights go and the one optimizer load rule (weight_files.py, [Note: weight files]: the file set
AutoTP and the pipeline replace with theirs) and the optimizer side with resharding
(zero_checkpoint.py, full_state.py). They read the run through one `CheckpointContext`
(checkpoint/context.py) built by `_checkpoint_context`, and ask the optimizer, never the stage,
which files this rank writes and how its state loads ([Note: checkpoint contract] in
checkpoint/contract.py). Every file holds plain types and loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

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
from zerospeed.runtime.tensor_parallel import checkpoint as tp_checkpoint
from zerospeed.runtime.tensor_parallel.weight_files import ShardedWeightFiles
from zerospeed.utils.logging import logger

__all__ = ["EngineCheckpointing"]


class EngineCheckpointing:
    """Mixin of DeepSpeedEngine: checkpoint save and load in DeepSpeed's layout."""

    # What this mixin reads of its host (DeepSpeedEngine sets each one; declared so mypy checks the uses).
    module: torch.nn.Module
    optimizer: Any
    _training_optimizer: Any
    lr_scheduler: Any
    param_names: dict[torch.nn.Parameter, str]
    dp_group: Any
    seq_dp_world_size: int
    num_experts: list[int]
    _config: Any
    global_steps: int
    global_samples: int
    skipped_steps: int
    load_universal_checkpoint: Callable[[], bool]
    train_batch_size: Callable[[], int]
    bfloat16_enabled: Callable[[], bool]

    # --- save -------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] = {},  # noqa: B006
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Called on every rank. See [Note: atomic save] for what a crash leaves behind."""
        if not save_dir:
            raise ValueError("save_checkpoint: save_dir must be a non-empty path")
        self._refuse_partitioned_without_optimizer("save_checkpoint")
        tag = default_tag(self.global_steps) if tag is None else str(tag)
        self._validate_tag(tag)
        ctx = self._checkpoint_context()
        files = ctx.optimizer.checkpoint_files(ctx.dp_rank, ctx.mp_rank)   # [Note: checkpoint contract]
        transaction = CheckpointTransaction(save_dir, tag, self._checkpoint_group()).begin()
        model_states = None
        if files.model_states is not None:
            model_states = build_model_states(ctx, dict(client_state), exclude_frozen_parameters)
        self._weight_files().write(ctx, transaction, model_states, exclude_frozen_parameters)   # [Note: weight files]
        if files.model_states is not None:
            transaction.write(files.model_states, to_plain(model_states))
        if files.optim_states is not None:
            transaction.write(files.optim_states, {
                C.OPTIMIZER_STATE_DICT: zero_state_for_deepspeed(to_plain(ctx.optimizer.state_dict())),
                C.DS_CONFIG: ctx.ds_config,
                C.DS_VERSION: DEEPSPEED_FORMAT_VERSION})
        transaction.commit(save_latest, extra_files=checkpoint_scripts())
        return True

    def _checkpoint_context(self) -> CheckpointContext:
        """What `checkpoint/` reads of this engine, built here only ([Note: checkpoint contract])."""
        return CheckpointContext(
            module=self.module, optimizer=NoOptimizer() if self._training_optimizer is None else self.optimizer,
            lr_scheduler=self.lr_scheduler, param_names=self.param_names,
            dp_rank=comm.get_rank(self.dp_group), dp_world_size=self.seq_dp_world_size,
            mp_rank=self._checkpoint_mp_rank(), mp_world_size=getattr(self, "mp_world_size", 1),
            tp_shards=self._checkpoint_tp_shards(),
            ds_config=self._config._param_dict, num_experts=list(self.num_experts),
            global_steps=self.global_steps, global_samples=self.global_samples, skipped_steps=self.skipped_steps)

    def _checkpoint_tp_shards(self) -> dict[str, list[int]] | None:
        """How AutoTP split the module's parameters (the model file records it), else None."""
        if getattr(self, "tensor_parallel", None) is None:
            return None
        return tp_checkpoint.shard_record(self.module)

    def _checkpoint_mp_rank(self) -> int:
        """The tp rank under AutoTP (DeepSpeed's mp rank in file names), else 0."""
        tensor_parallel = getattr(self, "tensor_parallel", None)
        return 0 if tensor_parallel is None else tensor_parallel.tp_rank

    def _checkpoint_group(self) -> Any:
        """Every rank that writes into the tag directory: the world under AutoTP, else the dp group."""
        return None if getattr(self, "tensor_parallel", None) is not None else self.dp_group

    def _validate_tag(self, tag: str) -> None:
        """`checkpoint.tag_validation`, as DeepSpeed: "Ignore" trusts the caller and costs nothing;
        "Warn" and "Fail" compare the tag across the ranks (one all-reduce). On a mismatch DeepSpeed
        only warns under "Warn" and writes each rank's files into its own tag, a split checkpoint
        that loads nowhere; one atomic commit cannot span several tags (the ranks would wait for
        each other's directories), so here "Warn" raises like "Fail" (docs/compatibility.md)."""
        mode = self._config.checkpoint_tag_validation_mode
        if mode == "Ignore":
            return
        digest = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "big")
        # MAX over (digest, -digest): the largest digest and minus the smallest, in one collective.
        bounds = torch.tensor([digest, -digest])
        comm.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX, group=self._checkpoint_group())
        if bounds[0].item() != -bounds[1].item():
            hint = "" if mode == "Fail" else (f' (checkpoint.tag_validation is "{mode}", but the ranks cannot '
                                              "commit one checkpoint under different tags)")
            raise ValueError(f"checkpoint tag {tag!r} of rank {comm.get_rank()} is not the same on all "
                             f"ranks{hint}; pass the same tag on every rank")

    # --- load -------------------------------------------------------------------------------------
    def _refuse_partitioned_without_optimizer(self, method: str) -> None:
        """ZeRO-3 without an optimizer: the module's state dict holds partitions, which a checkpoint
        would store as empty tensors ([Note: engine without an optimizer] in engine.py)."""
        if self._training_optimizer is None and self.optimizer is not None:
            raise NotImplementedError(f"{method} on a ZeRO-3 engine without an optimizer is not implemented; "
                                      "save the weights with save_16bit_model() or iter_full_weights(), "
                                      "load them into the model before initialize")

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        self._refuse_partitioned_without_optimizer("load_checkpoint")
        if self.load_universal_checkpoint():   # `latest_universal` and zero/<param>/*.pt
            return load_universal_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
        if tag is None:
            if not os.path.isdir(load_dir):  # DeepSpeed's return value, with the actual reason
                logger.warning(f"Unable to load a checkpoint: the checkpoint directory {load_dir} does not exist; "
                               "nothing was loaded")
                return None, None
            tag = read_latest(load_dir)  # a damaged `latest` raises, naming the file
            if tag is None:
                latest = os.path.join(load_dir, LATEST)
                logger.warning(f"Unable to find latest file at {latest}, if trying to load latest checkpoint "
                               "please ensure this file exists or pass an explicit checkpoint tag when loading "
                               "a checkpoint.")
                return None, None
        tag_dir = resolve_tag_dir(load_dir, str(tag))
        if not os.path.isdir(tag_dir):
            raise FileNotFoundError(f"checkpoint directory {tag_dir} does not exist")
        # [Note: weight files]: the one load sequence, the files in this order
        reader = CheckpointReader(tag_dir)   # every listed file present: a missing one is named
        ctx, weights = self._checkpoint_context(), self._weight_files()
        model_path = weights.model_file(ctx, reader)
        model_state = reader.load(model_path)
        saved = weights.saved_layout(ctx, reader, model_state)
        weights.load_module(ctx, reader, saved, model_state, load_module_strict, custom_load_fn)
        loaded_optimizer = loaded_scheduler = False
        if load_module_only:
            weights.load_optimizer(ctx, reader, saved, model_state, load_optimizer_states=False)
        else:
            loaded_scheduler = self._load_scheduler(model_state, load_lr_scheduler_states)
            self._load_counters(model_state)
            if self._training_optimizer is not None:
                weights.load_optimizer(ctx, reader, saved, model_state, load_optimizer_states)
                loaded_optimizer = load_optimizer_states
        comm.barrier(self._checkpoint_group())
        return model_path, _client_state(model_state, loaded_optimizer, loaded_scheduler)

    def _weight_files(self) -> WeightFiles:
        """Where this run's weights are in a checkpoint ([Note: weight files]): the model-states
        files, per tp rank under AutoTP."""
        return ShardedWeightFiles(self.bfloat16_enabled(), getattr(self, "mp_world_size", 1))

    def _load_scheduler(self, model_state: dict[str, Any], wanted: bool) -> bool:
        saved = model_state.get(C.LR_SCHEDULER)
        if wanted and self.lr_scheduler is not None and saved is not None:
            self.lr_scheduler.load_state_dict(saved)
            return True
        return False

    def _load_counters(self, model_state: dict[str, Any]) -> None:
        self.global_steps = int(model_state[C.GLOBAL_STEPS])
        self.global_samples = int(model_state.get(C.GLOBAL_SAMPLES, self.global_steps * self.train_batch_size()))
        self.skipped_steps = int(model_state[C.SKIPPED_STEPS])
        self.loaded_checkpoint_dp_world_size = model_state.get(C.DP_WORLD_SIZE)
        self.loaded_checkpoint_mp_world_size = model_state.get(C.MP_WORLD_SIZE)


def _client_state(model_state: dict[str, Any], loaded_optimizer: bool, loaded_scheduler: bool) -> dict[str, Any]:
    excluded = set(C.CLIENT_STATE_EXCLUDED_KEYS)
    if loaded_optimizer:
        excluded.add(C.OPTIMIZER)
    if loaded_scheduler:
        excluded.add(C.LR_SCHEDULER)
    return {key: value for key, value in model_state.items() if key not in excluded}

