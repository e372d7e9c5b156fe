"""DeepSpeed's one-line engine accessors, kept out of engine.py so that file holds behaviour only."""

from __future__ import annotations

from typing import Any

import torch


class EngineAccessors:
    _config: Any
    optimizer: Any

    # --- batch sizes ----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    # --- config ---------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization_stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_optimization_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_optimization_stage >= 3

    def fp16_enabled(self) -> bool:
        return self._config.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16_enabled

    bf16_enabled = bfloat16_enabled

    def fp16_auto_cast(self) -> bool:
        return bool(self._config.fp16.auto_cast)

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16_enabled and self._config.loss_scale == 0

    def loss_scale(self) -> float:
        return self._config.loss_scale

    def communication_data_type_name(self) -> str:
        return str(self.communication_data_type)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        return self.precision.param_dtype, self.precision.grad_accum_dtype

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    # --- optimizer state --------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_loss_scale(self) -> float:
        return self.optimizer.cur_scale

    # --- Mixture of Experts (engine_moe.py) -------------------------------------------------------
    @property
    def _moe_info(self) -> Any:
        from zerospeed.runtime.engine_moe import MoEInfo

        return self.__dict__.get("_moe") or MoEInfo()   # an engine built without _init_module has none

    @property
    def has_moe_layers(self) -> bool:
        return self._moe_info.has_moe_layers

    @property
    def num_experts(self) -> list[int]:
        return self._moe_info.num_experts

    @property
    def moe_layers(self) -> list[Any]:
        return self._moe_info.moe_layers

    @property
    def gate_modules(self) -> list[Any]:
        return self._moe_info.gate_modules

    # --- sequence parallelism -------------------------------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        """The Ulysses group (DeepSpeed's attribute is only set with sequence_parallel_size > 1)."""
        return self.seq_parallel_group  # type: ignore[attr-defined]
