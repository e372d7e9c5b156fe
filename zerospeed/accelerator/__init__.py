"""Device abstraction: `get_accelerator()` returns the CPU or CUDA implementation.

The choice is made once per process: `ZS_ACCELERATOR` (or DeepSpeed's `DS_ACCELERATOR`)
forces one of `cpu` / `cuda`; otherwise CUDA is used when available.
"""

from zerospeed.accelerator.abstract import Accelerator
from zerospeed.accelerator.real_accelerator import get_accelerator, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
