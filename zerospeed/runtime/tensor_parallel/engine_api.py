"""The engine's AutoTP surface (DeepSpeed's names): accessors and full 16-bit weights under TP."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.tensor_parallel.config import TPTrainingConfig
from zerospeed.runtime.tensor_parallel.setup import TensorParallelSetup, setup_autotp
from zerospeed.runtime.tensor_parallel.state_dict import consolidated_state_dict
from zerospeed.utils.logging import logger

__all__ = ["EngineTensorParallel"]


class EngineTensorParallel:
    """Mixin of DeepSpeedEngine; ``tensor_parallel`` is None unless ``autotp_size > 1``."""

    tensor_parallel: TensorParallelSetup | None = None
    _config: Any
    module: torch.nn.Module
    optimizer: Any
    dp_group: Any
    run_groups: Any   # the run's frozen groups (comm/run_groups.py), built before AutoTP shards

    def _init_tensor_parallel(self, model: torch.nn.Module, raw_config: dict[str, Any], mpu: Any) -> Any:
        """Shard ``model`` when AutoTP is on; returns the data-parallel group it built (else None)."""
        self.tensor_parallel = setup_autotp(model, raw_config, mpu, self.run_groups)
        return None if self.tensor_parallel is None else self.tensor_parallel.dp_group

    def _tp_batch_config(self, raw_config: dict[str, Any], dp_world_size: int) -> dict[str, Any]:
        """The ds_config for the batch triangle: under AutoTP a `train_batch_size` that counts every
        rank (micro x accumulation x world, which DeepSpeed 0.19.8 checks and accelerate writes for
        "auto") is restated for the data-parallel size, with a warning; the micro batch and the
        accumulation steps are what train. Any other mismatch is left for the config to report."""
        if self.tensor_parallel is None:
            return raw_config
        tbs, mbs = raw_config.get("train_batch_size"), raw_config.get("train_micro_batch_size_per_gpu")
        gas = raw_config.get("gradient_accumulation_steps", 1)
        if not all(isinstance(v, int) for v in (tbs, mbs, gas)):
            return raw_config
        world = dp_world_size * self.tensor_parallel.tp_size
        if tbs == mbs * gas * world and tbs != mbs * gas * dp_world_size:
            logger.warning(f"train_batch_size {tbs} counts all {world} ranks (DeepSpeed's AutoTP convention); "
                           f"with tensor_parallel.autotp_size {self.tensor_parallel.tp_size} the batch trained per "
                           f"step is {mbs * gas * dp_world_size} (micro {mbs} x accumulation {gas} x {dp_world_size} "
                           "data-parallel ranks)")
            return {**raw_config, "train_batch_size": mbs * gas * dp_world_size}
        return raw_config

    # --- DeepSpeed's accessors -------------------------------------------------------------------
    def autotp_size(self) -> int:
        return self._config.tensor_parallel_config.autotp_size

    def tensor_parallel_config(self) -> TPTrainingConfig:
        return self._config.tensor_parallel_config

    def get_tensor_parallel_rank(self) -> int:
        return 0 if self.tensor_parallel is None else self.tensor_parallel.tp_rank

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_parallel_rank()

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank(self.dp_group)

    @property
    def mp_world_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.tp_size

    # --- full weights ----------------------------------------------------------------------------
    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """Under AutoTP: the unsharded model's state dict on global rank 0, {} on the others (as
        DeepSpeed); collective, every rank must call it."""
        if self.tensor_parallel is None:
            return super()._consolidated_16bit_state_dict(exclude_frozen_parameters)  # type: ignore[misc]
        full = self._full_weights(self._tp_rank_state_dict(exclude_frozen_parameters))
        return full if full is not None and comm.get_rank() == 0 else {}

    def _tp_rank_state_dict(self, exclude_frozen_parameters: bool) -> dict[str, Any] | None:
        """This tp rank's pieces, whole over the data-parallel group. At ZeRO-3 they are gathered
        over it and land on dp rank 0 only (None elsewhere): the tp group of dp rank 0 then joins
        them ([Note: AutoTP with ZeRO-3] in setup.py)."""
        return self._module_state_dict_16bit(exclude_frozen_parameters)  # type: ignore[attr-defined]

    def _full_weights(self, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
        """``state_dict`` with split parameters made whole (unchanged without AutoTP). Collective
        over the tp group; None (a stage-3 rank off dp rank 0, as its tp peers) stays None."""
        if self.tensor_parallel is None or state_dict is None:
            return state_dict
        return consolidated_state_dict(self.module, self.tensor_parallel.tp_group, state=state_dict)
