"""`CopyCounter`: counts copy-like torch ops that read or write given storages (a test of "no copy")."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COPY_OPS = ("copy_", "_to_copy", "cat", "clone")


class CopyCounter(TorchDispatchMode):
    """Inside `with`: each copy-like op one of whose tensors (inputs or output) lives on one of
    `storages` (their `untyped_storage().data_ptr()`) adds one to `count`."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in COPY_OPS:
            tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
                self.count += 1
        return out
