"""Builder of the `cpu_adam` op: the fused kernel behind `zerospeed.ops.adam.DeepSpeedCPUAdam`."""

from __future__ import annotations

from zerospeed.ops.op_builder.builder import OpBuilder

__all__ = ["CPUAdamBuilder"]


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    BUILD_VAR = "ZS_BUILD_CPU_ADAM"

    def sources(self) -> list[str]:
        return ["ops/csrc/adam/cpu_adam.cpp"]
