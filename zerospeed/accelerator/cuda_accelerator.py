"""CUDA accelerator: thin forwards to `torch.cuda`; NCCL for communication."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.accelerator.abstract import Accelerator


class CUDAAccelerator(Accelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def Stream(self, *args: Any, **kwargs: Any) -> torch.cuda.Stream:  # noqa: N802
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.default_stream(device_index)

    def Event(self, *args: Any, **kwargs: Any) -> torch.cuda.Event:  # noqa: N802
        return torch.cuda.Event(*args, **kwargs)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)
