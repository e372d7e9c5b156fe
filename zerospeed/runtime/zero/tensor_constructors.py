"""DeepSpeed's tensor-constructor wrapper for `zero.Init` and the original constructors it saves.

DeepSpeed's `zero.Init` swaps `torch.empty`, `torch.zeros`, `torch.arange`, ... for wrapped versions
that place new tensors on the Init's device and cast floating ones to its dtype. transformers
reads `partition_parameters.zero_wrapper_for_fp_tensor_constructor` and `_orig_torch_arange` to
keep `torch.arange` out of the cast (RoPE buffers) and swaps the wrapper for the duration of
`from_pretrained`. These are the objects it expects, at DeepSpeed's path; zerospeed's `zero.Init`
converts parameters after each module's `__init__` instead of patching constructors, so a client's
swap of this wrapper changes nothing in zerospeed (docs/compatibility.md, Client libraries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["zero_wrapper_for_fp_tensor_constructor"]

# Saved at import, before anything could have wrapped them.
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None = None) -> Callable[..., torch.Tensor]:
    """`fn` with `device` defaulting to `target_device` and floating results cast to `target_fp_dtype`."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn
