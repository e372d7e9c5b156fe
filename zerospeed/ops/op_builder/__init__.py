"""Native ops built just in time: one `OpBuilder` per op, the `ALL_OPS` registry."""

from zerospeed.ops.op_builder.all_ops import ALL_OPS, get_builder
from zerospeed.ops.op_builder.builder import OpBuilder, OpBuildError, extensions_root
from zerospeed.ops.op_builder.cpu_adagrad import CPUAdagradBuilder
from zerospeed.ops.op_builder.cpu_adam import CPUAdamBuilder
from zerospeed.ops.op_builder.cpu_lion import CPULionBuilder

__all__ = ["ALL_OPS", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "OpBuildError", "OpBuilder",
           "extensions_root", "get_builder"]
