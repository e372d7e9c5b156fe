"""The registry of every native op: `ALL_OPS = {name: builder}` (DeepSpeed's `all_ops.ALL_OPS`).

DeepSpeed discovers builders by scanning its op_builder package; ours are few, so they are
listed here by hand and a test checks every `*Builder` class is in the list.
"""

from __future__ import annotations

from zerospeed.ops.op_builder.builder import OpBuilder
from zerospeed.ops.op_builder.cpu_adagrad import CPUAdagradBuilder
from zerospeed.ops.op_builder.cpu_adam import CPUAdamBuilder
from zerospeed.ops.op_builder.cpu_lion import CPULionBuilder

__all__ = ["ALL_OPS", "BUILDER_CLASSES", "get_builder"]

BUILDER_CLASSES: tuple[type[OpBuilder], ...] = (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder)
ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in BUILDER_CLASSES}


def get_builder(name: str) -> OpBuilder:
    if name not in ALL_OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(ALL_OPS))}")
    return ALL_OPS[name]
