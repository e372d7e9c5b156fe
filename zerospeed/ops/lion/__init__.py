"""DeepSpeed's `deepspeed.ops.lion`."""

from zerospeed.ops.lion.cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
