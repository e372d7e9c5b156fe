"""Builder of the `cpu_adagrad` op: the fused kernel behind `zerospeed.ops.adagrad.DeepSpeedCPUAdagrad`."""

from __future__ import annotations

from zerospeed.ops.op_builder.builder import OpBuilder

__all__ = ["CPUAdagradBuilder"]


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    BUILD_VAR = "ZS_BUILD_CPU_ADAGRAD"

    def sources(self) -> list[str]:
        return ["ops/csrc/adagrad/cpu_adagrad.cpp"]
