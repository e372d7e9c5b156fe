"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save` (accelerate's ZeRO-1/2 `save_model`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of `item` (tensors in nested dicts / lists / tuples) with every tensor cloned onto `device`.

    `torch.save` of a view writes its whole storage; flat-buffer views (ZeRO's parameters) would
    each carry the entire buffer. Clones own exactly their elements. Non-tensors pass through.
    """
    if torch.is_tensor(item):
        target = torch.device(device)
        # .to() onto another device already copies; on the same device it returns the view itself.
        return item.detach().clone() if item.device == target else item.detach().to(target)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device) for key, value in item.items()})
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
        return type(item)(*(clone_tensors_for_torch_save(value, device) for value in item))
    if isinstance(item, list | tuple):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    return item
