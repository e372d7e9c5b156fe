"""Builder of the `cpu_lion` op: the fused kernel behind `zerospeed.ops.lion.DeepSpeedCPULion`."""

from __future__ import annotations

from zerospeed.ops.op_builder.builder import OpBuilder

__all__ = ["CPULionBuilder"]


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    BUILD_VAR = "ZS_BUILD_CPU_LION"

    def sources(self) -> list[str]:
        return ["ops/csrc/lion/cpu_lion.cpp"]
