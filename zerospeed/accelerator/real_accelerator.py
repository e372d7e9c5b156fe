"""Choosing the accelerator once per process."""

from __future__ import annotations

import os

from zerospeed.accelerator.abstract import Accelerator

_SUPPORTED = ("cpu", "cuda")
_accelerator: Accelerator | None = None


def _requested_name() -> str | None:
    name = os.environ.get("ZS_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if name is None:
        return None
    name = name.strip().lower()
    if name not in _SUPPORTED:
        raise ValueError(f"ZS_ACCELERATOR={name!r} is not one of {', '.join(_SUPPORTED)}")
    return name


def _build(name: str) -> Accelerator:
    if name == "cuda":
        from zerospeed.accelerator.cuda_accelerator import CUDAAccelerator

        accelerator: Accelerator = CUDAAccelerator()
        if not accelerator.is_available():
            raise RuntimeError("ZS_ACCELERATOR=cuda but torch.cuda.is_available() is False")
        return accelerator
    from zerospeed.accelerator.cpu_accelerator import CPUAccelerator

    return CPUAccelerator()


def get_accelerator() -> Accelerator:
    """The process's accelerator: the environment's choice, else CUDA when available, else CPU."""
    global _accelerator
    if _accelerator is None:
        name = _requested_name()
        if name is None:
            import torch

            name = "cuda" if torch.cuda.is_available() else "cpu"
        _accelerator = _build(name)
    return _accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    global _accelerator
    _accelerator = accelerator
