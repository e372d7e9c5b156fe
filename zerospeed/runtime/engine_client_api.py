"""Engine methods that client libraries (transformers, accelerate, TRL, Lightning) call.

Kept out of engine.py: each is a small piece of DeepSpeed's engine surface with its own contract:
`zero_gather_16bit_weights_on_model_save()` (accelerate's save), `_consolidated_16bit_state_dict`,
`destroy()` (accelerate frees the engine before a second `train()`), `compile(backend=,
compile_kwargs=)` (accelerate >= DeepSpeed 0.14.4 with a dynamo backend) and `is_compiled`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.runtime.base_optimizer import NOT_PARTITIONED, DeepSpeedOptimizer

__all__ = ["EngineClientAPI"]


class EngineClientAPI:
    """Mixin for `DeepSpeedEngine`; relies on `_config`, `module`, `optimizer` and the accessors."""

    _config: Any
    module: torch.nn.Module
    optimizer: DeepSpeedOptimizer | None
    _is_compiled: bool = False

    def _link_fragment_owner(self) -> None:
        """Let `deepspeed.utils.safe_get_*(param)` find the engine (and so the optimizer) of `param`."""
        from zerospeed.utils.tensor_fragment import link_params

        link_params(self.module.parameters(), self)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`stage3_gather_16bit_weights_on_model_save`: whether a 16-bit model can be saved at stage 3."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The full 16-bit state dict where weights are partitioned (stage 3); DeepSpeed raises otherwise."""
        if self.optimizer is None:
            raise ValueError(NOT_PARTITIONED)
        return self.optimizer.consolidated_16bit_state_dict(self.module, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Remove the hooks this engine put on the model and its parameters, so that the model can be
        wrapped by a new engine (accelerate calls this before re-preparing a model)."""
        if self.optimizer is not None:
            self.optimizer.destroy()

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile with `torch.compile` (DeepSpeed's signature): the whole module, or at stage 3
        each transformer block with the ZeRO hooks outside (runtime/compiled_regions.py)."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...) is DeepCompile, which zerospeed does not implement")
        if self._is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        kwargs.pop("backend", None)  # DeepSpeed: the backend argument wins over compile_kwargs
        from zerospeed.runtime.compiled_regions import compile_model

        offload = getattr(self.optimizer, "parameter_offload", None)
        self._compiled_modules = compile_model(self.module, backend, kwargs, offload)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled
