"""Engine methods that client libraries (transformers, accelerate, TRL, Lightning) call.

Kept out of engine.py: each is a small piece of DeepSpeed's engine surface with its own contract:
`zero_gather_16bit_weights_on_model_save()` (accelerate's save), `_consolidated_16bit_state_dict`,
`destroy()` (accelerate frees the engine before a second `train()`), `compile(backend=,
compile_kwargs=)` (accelerate >= DeepSpeed 0.14.4 with a dynamo backend), `is_compiled`,
`offload_states()` / `reload_states()` (RL loops; the mechanism is runtime/zero/state_offload.py), and
zerospeed's own `iter_full_weights` (the weight stream RL loops hand to a generation engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from zerospeed.runtime.base_optimizer import NOT_PARTITIONED, DeepSpeedOptimizer
from zerospeed.runtime.tensor_parallel.engine_component import EngineTensorParallel
from zerospeed.runtime.zero.offload.config import OffloadDeviceEnum
from zerospeed.runtime.zero.state_offload import NO_OPTIMIZER, PARAM_OFFLOAD, StatesOffloader, refine_include

__all__ = ["EngineClientAPI"]


class EngineClientAPI:
    """Mixin for `DeepSpeedEngine`; relies on `_config`, `module`, `optimizer` and the accessors."""

    _config: Any
    module: torch.nn.Module
    optimizer: DeepSpeedOptimizer | None
    tensor_parallel: EngineTensorParallel
    _is_compiled: bool = False
    _states_offloader: StatesOffloader | None = None

    def _link_fragment_owner(self) -> None:
        """Let `deepspeed.utils.safe_get_*(param)` find the engine (and so the optimizer) of `param`."""
        from zerospeed.utils.tensor_fragment import link_params

        link_params(self.module.parameters(), self)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`stage3_gather_16bit_weights_on_model_save`: whether a 16-bit model can be saved at stage 3."""
        return bool(self._config.zero_config.gather_16bit_weights_on_model_save)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The full 16-bit state dict where weights are partitioned (stage 3); DeepSpeed raises otherwise.
        Under AutoTP: the unsharded model's on global rank 0, {} on the others (collective)."""
        if self.tensor_parallel.enabled:
            return self.tensor_parallel.consolidated_16bit_state_dict(
                self._module_state_dict_16bit, exclude_frozen_parameters)  # type: ignore[attr-defined]
        if self.optimizer is None:
            raise ValueError(NOT_PARTITIONED)
        return self._module_state_dict_16bit(exclude_frozen_parameters)  # type: ignore[attr-defined]

    def iter_full_weights(self, bucket_bytes: int = 256 * 2**20) -> Iterator[tuple[str, torch.Tensor]]:
        """zerospeed's own: `(name, full tensor)` for every parameter, gathered `bucket_bytes` at a
        time, for handing the weights to a generation engine (zero/weight_stream.py). Collective
        at ZeRO-3: every data-parallel rank iterates."""
        from zerospeed.runtime.zero.weight_stream import iter_full_weights

        if self.tensor_parallel.enabled:
            raise NotImplementedError("iter_full_weights with AutoTP (tensor_parallel.autotp_size > 1) is not "
                                      "implemented: the weights are split over the tp group")
        return iter_full_weights(self.module, bucket_bytes)

    def destroy(self) -> None:
        """Remove the hooks this engine put on the model and its parameters, so that the model can be
        wrapped by a new engine (accelerate calls this before re-preparing a model)."""
        if self.optimizer is not None:
            self.optimizer.destroy()

    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile with `torch.compile` (DeepSpeed's signature): each transformer block, the ZeRO
        hooks outside (runtime/compiled_regions.py); a model without blocks whole."""
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

    def offload_states(self, include: Any = None, device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move the included states (`OffloadStateTypeEnum`; None: all) to host memory and free the
        device memory they held, until `reload_states()` (DeepSpeed's signature; ZeRO 0 to 3)."""
        zero, stage = self._config.zero_config, self._config.zero_optimization_stage
        states = refine_include(include, zero.offload_optimizer_device.value != "none", stage >= 3)
        if zero.offload_param_device.value != "none":
            raise ValueError(PARAM_OFFLOAD)
        wrapper = self._states_wrapper()   # refuses without an optimizer
        if self._states_offloader is None:
            self._states_offloader = StatesOffloader()
        self._states_offloader.offload(wrapper, self.module, states, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states()` moved; training continues bit for bit."""
        self._states_wrapper()
        if self._states_offloader is not None:
            self._states_offloader.reload(non_blocking)

    def _states_wrapper(self) -> Any:
        if self.optimizer is None or not hasattr(self.optimizer, "offloadable_state_tensors"):
            raise ValueError(NO_OPTIMIZER)
        return self.optimizer
