"""`EngineTensorParallel`: AutoTP as a component the engine holds (`engine.tensor_parallel`).

Built once, first in `DeepSpeedEngine.__init__` (it shards the model and builds the data x tensor
grid, setup.py), and always present: with AutoTP off it answers as one tensor-parallel rank (rank
0 of 1, no groups) and passes weights through, so the engine never branches on whether it exists.
The engine's DeepSpeed methods (`get_tensor_parallel_rank`, `mp_world_size`,
`_consolidated_16bit_state_dict`, ...) are one-line delegates to it in engine_accessors.py and
engine_client_api.py; it reads nothing of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.tensor_parallel.plan import Partition
from zerospeed.runtime.tensor_parallel.setup import TensorParallelSetup, setup_autotp
from zerospeed.runtime.tensor_parallel.state_dict import consolidated_state_dict
from zerospeed.utils.logging import logger

__all__ = ["EngineTensorParallel"]

# A function returning this rank's 16-bit weights, whole over its data-parallel group (None on a
# ZeRO-3 rank off dp rank 0): the engine's `_module_state_dict_16bit`.
RankStateDict = Callable[[bool], "dict[str, Any] | None"]


class EngineTensorParallel:
    """AutoTP's groups and plan for one engine; ``setup`` is None unless ``autotp_size > 1``."""

    def __init__(self, setup: TensorParallelSetup | None, module: torch.nn.Module) -> None:
        self.setup, self.module = setup, module

    @classmethod
    def build(cls, model: torch.nn.Module, raw_config: dict[str, Any], mpu: Any,
              run_groups: RunGroups | None = None) -> EngineTensorParallel:
        """Shard ``model`` when the config (or `tp_model_init`) asks for AutoTP, over the run's
        tensor-parallel group ([Note: run groups]); else an inactive component."""
        return cls(setup_autotp(model, raw_config, mpu, run_groups), model)

    # --- the run's tensor-parallel place ----------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.setup is not None

    @property
    def tp_group(self) -> Any:
        """The tensor-parallel group (None when AutoTP is off)."""
        return None if self.setup is None else self.setup.tp_group

    @property
    def dp_group(self) -> Any:
        """The data-parallel group AutoTP's grid built (None when off: the engine builds its own)."""
        return None if self.setup is None else self.setup.dp_group

    @property
    def tp_size(self) -> int:
        return 1 if self.setup is None else self.setup.tp_size

    @property
    def tp_rank(self) -> int:
        return 0 if self.setup is None else self.setup.tp_rank

    @property
    def plan(self) -> dict[str, Partition]:
        """Which linear was split how (empty when off)."""
        return {} if self.setup is None else self.setup.plan

    # --- the batch ----------------------------------------------------------------------------------
    def batch_config(self, raw_config: dict[str, Any], dp_world_size: int) -> dict[str, Any]:
        """The ds_config for the batch triangle: under AutoTP a `train_batch_size` that counts every
        rank (micro x accumulation x world, which DeepSpeed 0.19.8 checks and accelerate writes for
        "auto") is restated for the data-parallel size, with a warning; the micro batch and the
        accumulation steps are what train. Any other mismatch is left for the config to report."""
        if self.setup is None:
            return raw_config
        tbs, mbs = raw_config.get("train_batch_size"), raw_config.get("train_micro_batch_size_per_gpu")
        gas = raw_config.get("gradient_accumulation_steps", 1)
        if not all(isinstance(v, int) for v in (tbs, mbs, gas)):
            return raw_config
        world = dp_world_size * self.tp_size
        if tbs == mbs * gas * world and tbs != mbs * gas * dp_world_size:
            logger.warning(f"train_batch_size {tbs} counts all {world} ranks (DeepSpeed's AutoTP convention); "
                           f"with tensor_parallel.autotp_size {self.tp_size} the batch trained per "
                           f"step is {mbs * gas * dp_world_size} (micro {mbs} x accumulation {gas} x {dp_world_size} "
                           "data-parallel ranks)")
            return {**raw_config, "train_batch_size": mbs * gas * dp_world_size}
        return raw_config

    # --- full weights -------------------------------------------------------------------------------
    def full_weights(self, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
        """``state_dict`` with split parameters made whole (unchanged without AutoTP). Collective
        over the tp group; None (a stage-3 rank off dp rank 0, as its tp peers) stays None."""
        if self.setup is None or state_dict is None:
            return state_dict
        return consolidated_state_dict(self.module, self.setup.tp_group, state=state_dict)

    def consolidated_16bit_state_dict(self, rank_state_dict: RankStateDict,
                                      exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The unsharded model's 16-bit state dict on global rank 0, {} on the others (as DeepSpeed);
        collective, every rank calls it. ``rank_state_dict`` gives this tp rank's pieces, whole over
        the data-parallel group: at ZeRO-3 they land on dp rank 0 only (None elsewhere), and the tp
        group of dp rank 0 then joins them ([Note: AutoTP with ZeRO-3] in setup.py)."""
        full = self.full_weights(rank_state_dict(exclude_frozen_parameters))
        return full if full is not None and comm.get_rank() == 0 else {}
