"""`LayerSpec` and `TiedLayerSpec`: a layer described before it is built, so that each pipeline
stage builds only its own layers. A leaf: partitioning, tie groups and `PipelineModule` all read
specs, and none of them is needed to describe one. `zerospeed.runtime.pipe.module` re-exports both
at DeepSpeed's import path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerospeed import comm
from zerospeed.utils.logging import log_dist

__all__ = ["LayerSpec", "TiedLayerSpec"]


class LayerSpec:
    """`typename(*module_args, **module_kwargs)`, built only on the stage that owns the layer."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = comm.get_rank() if comm.is_initialized() else -1

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> torch.nn.Module:
        if log:
            log_dist(f"RANK={self.global_rank} building {self!r}", ranks=[self.global_rank])
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` attribute(s) are shared by every layer with the same `key`;
    `forward_fn(module, inputs)` lets a use differ (an embedding reused as the LM head)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[..., Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
