"""How a PipelineModule's layers are split into stages: pure functions over per-layer weights.

`parts` is the boundary list of length num_parts + 1: part p holds layers [parts[p], parts[p+1]).
Both functions return the boundaries DeepSpeed 0.19.8 returns (`deepspeed/runtime/utils.py`), as
plain Python ints (DeepSpeed returns numpy integers from `partition_balanced`, which is what makes
`seed_layers=True` raise a TypeError in `random.seed` on Python >= 3.11).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from zerospeed.runtime.pipe.layer_spec import LayerSpec

__all__ = ["layer_type_name", "partition_balanced", "partition_uniform", "partition_weights"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts; the first `num_items % num_parts` parts get one more (DeepSpeed's rule)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising (heaviest part - lightest part), by dynamic programming.

    best[i][j] describes the best split of the first i layers into j parts: its cost (max - min
    of the part sums), its max and its min. Among equal costs the last split point wins, which is
    the tie rule that reproduces DeepSpeed's boundaries."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    inf = math.inf
    cost = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    high = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    low = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    split = [[0] * (num_parts + 1) for _ in range(n + 1)]
    cost[0][0], high[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                segment = prefix[i] - prefix[k]
                seg_high, seg_low = max(high[k][j - 1], segment), min(low[k][j - 1], segment)
                if cost[i][j] >= seg_high - seg_low:
                    cost[i][j], high[i][j], low[i][j], split[i][j] = seg_high - seg_low, seg_high, seg_low, k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(split[parts[-1]][j])
    return parts[::-1]


def layer_type_name(layer: Any) -> str | None:
    """The class name partitioning and checkpointing match against (None for a nameless callable)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_numel(layer: Any) -> int:
    module = layer.build() if isinstance(layer, LayerSpec) else layer
    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def partition_weights(method: str, layers: Sequence[Any], num_parts: int) -> list[int]:
    """Boundaries for DeepSpeed's `partition_method`: 'uniform', 'parameters' or 'type:<regex>'."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layers), num_parts)
    if lowered == "parameters":
        return partition_balanced([_trainable_numel(layer) for layer in layers], num_parts)
    if lowered.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        binary = [1 if (name := layer_type_name(layer)) is not None and pattern.search(name) else 0
                  for layer in layers]
        if not any(binary):
            raise ValueError(f"partition_method {method!r} matched no layer; layer types are "
                             f"{sorted({n for layer in layers if (n := layer_type_name(layer)) is not None})}")
        return partition_balanced(binary, num_parts)
    raise NotImplementedError(f"Partitioning method {method} not implemented; use 'parameters', 'uniform' "
                              "or 'type:<regex>'")
