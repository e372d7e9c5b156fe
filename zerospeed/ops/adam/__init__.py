"""DeepSpeed's `deepspeed.ops.adam`: `DeepSpeedCPUAdam` (fused CPU op) and `FusedAdam`."""

from zerospeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from zerospeed.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
