"""The interface every accelerator implements (a subset of DeepSpeed's `DeepSpeedAccelerator`)."""

from __future__ import annotations

import abc
from typing import Any

import torch


class Accelerator(abc.ABC):
    """What the runtime needs from a device: names, streams, events, memory and the comm backend."""

    _name: str = ""
    _communication_backend_name: str = ""

    # --- identity -------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    # --- execution ------------------------------------------------------------------------
    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def Stream(self, *args: Any, **kwargs: Any) -> Any: ...  # noqa: N802 (DeepSpeed's name)

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any: ...

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def Event(self, *args: Any, **kwargs: Any) -> Any: ...  # noqa: N802

    # --- memory ---------------------------------------------------------------------------
    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    def empty_cache(self) -> None:
        return None

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # --- dtypes ---------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name
