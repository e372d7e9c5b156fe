"""The ZeRO-3 hook surface TRL drives (DeepSpeed's `parameter_offload` attribute names).

For generation under ZeRO-3, TRL gathers every parameter, removes the module hooks
(`forward_hooks` / `backward_hooks`, clearing `ds_active_sub_modules` via
`module.ds_external_parameters()`), generates, then invalidates the coordinator's trace
(`param_coordinator.is_invalid_trace()` / `_invalidate_trace()`) and reinstalls the hooks with
`_register_deepspeed_module(module)`. zerospeed's backward hooks live inside the forward hooks
(autograd functions on the module's outputs), so `backward_hooks` is always an empty list.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["OffloadClientHooks", "ds_external_parameters"]


def ds_external_parameters(module: torch.nn.Module) -> list[tuple[int, torch.nn.Parameter]]:
    """(key, parameter) pairs registered with `register_external_parameter` (DeepSpeed's method)."""
    from zerospeed.runtime.zero.partition_parameters import external_parameters

    return [(param.zs_state.ds_id, param) for param in external_parameters(module)]


class OffloadClientHooks:
    """Mixin for `DeepSpeedZeRoOffload`; relies on its `_handles`, `coordinator`, `_install_hooks`."""

    _handles: list[Any]
    coordinator: Any

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        """(Re)install the fetch/release hooks on `module` and its submodules."""
        self._install_hooks(module)  # type: ignore[attr-defined]
        for sub in module.modules():
            sub.__dict__["ds_external_parameters"] = types.MethodType(ds_external_parameters, sub)

    @property
    def forward_hooks(self) -> list[Any]:
        return self._handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[Any]) -> None:
        if not handles:
            # Hooks gone (TRL then gathers and releases parameters itself): the coordinator must
            # not count as fetched what a later GatheredParameters exit will release behind it.
            self.partition_all_parameters()  # type: ignore[attr-defined]
        self._handles = list(handles)

    @property
    def backward_hooks(self) -> list[Any]:
        return self.__dict__.setdefault("_backward_hooks", [])

    @backward_hooks.setter
    def backward_hooks(self, handles: list[Any]) -> None:
        self.__dict__["_backward_hooks"] = list(handles)

    @property
    def param_coordinator(self) -> Any:
        return self.coordinator

    def destroy(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
